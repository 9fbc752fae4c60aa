"""The named-axis grid (`pipeflow.grid.Grid`): the layout every group is asked of."""

import itertools

import pytest

from pipeflow.grid import AXES, Grid, GridError

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 2, 4), (4, 1, 2)]


@pytest.mark.parametrize("p,d,t", SHAPES)
def test_rank_is_the_documented_layout_and_coords_invert_it(p, d, t):
    g = Grid(p, d, t)
    seen = set()
    for s, r, k in itertools.product(range(p), range(d), range(t)):
        rank = g.rank(pipeline=s, data=r, tensor=k)
        assert rank == (s * d + r) * t + k
        assert tuple(g.coords(rank)) == (s, r, k)
        seen.add(rank)
    assert seen == set(range(g.size)) and g.size == p * d * t


@pytest.mark.parametrize("p,d,t", SHAPES)
@pytest.mark.parametrize("axes", ["pipeline", "data", "tensor", ("pipeline", "tensor"),
                                  ("data", "tensor"), AXES])
def test_groups_partition_the_world_and_vary_only_their_axes(p, d, t, axes):
    g = Grid(p, d, t)
    names = (axes,) if isinstance(axes, str) else axes
    groups = g.groups(axes)
    assert sorted(r for grp in groups for r in grp) == list(range(g.size))
    assert [grp[0] for grp in groups] == sorted(grp[0] for grp in groups)
    for i, grp in enumerate(groups):
        assert len(grp) == g.degree(axes)
        fixed = {a for a in AXES if a not in names}
        for rank in grp:
            assert g.group(axes, rank) == grp and g.index(axes, rank) == i
            assert all(getattr(g.coords(rank), a) == getattr(g.coords(grp[0]), a)
                       for a in fixed)
    if isinstance(axes, str):        # a rank's place in its group is its coordinate
        for rank in range(g.size):
            assert g.position(axes, rank) == getattr(g.coords(rank), axes)


def test_tensor_ranks_are_consecutive_and_replicas_neighbours():
    g = Grid(pipeline=2, data=2, tensor=4)
    assert g.group("tensor", 5) == [4, 5, 6, 7]
    assert g.group("data", 5) == [1, 5]
    assert g.group("pipeline", 5) == [5, 13]


@pytest.mark.parametrize("bad", [dict(pipeline=0), dict(pipeline=2, tensor=-1),
                                 dict(pipeline=1, data=1.5), dict(pipeline=True)])
def test_bad_degrees_are_refused(bad):
    with pytest.raises(GridError, match="must be a whole number"):
        Grid(**bad)


def test_bad_questions_are_refused():
    g = Grid(2, 2, 2)
    with pytest.raises(GridError, match="outside the grid"):
        g.coords(8)
    with pytest.raises(GridError, match="tensor coordinate 2"):
        g.rank(0, 0, 2)
    with pytest.raises(GridError, match="expected distinct names"):
        g.group("replica", 0)
