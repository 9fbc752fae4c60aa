"""Executing a plan on one rank: the stage's resources (`stage`), the instruction runner
(`runner`), batches (`batch`), the optimizer step (`optim_step`), data parallelism
(`data_parallel`), mixed precision (`precision`), recomputation (`recompute`), checkpoints
(`checkpoint`), failure handling (`failure`), partitioning (`partition`) and random streams
(`rng`)."""
