import numpy as np

from pagedserve.executor.block_table import BlockTableArray


def test_rows_grow_append_and_are_reused():
    t = BlockTableArray(rows=2, cols=2)
    a = t.add([5, 6])
    b = t.add([7])
    c = t.add([1, 2, 3])  # a third row and a wider table: both dimensions grow
    assert (a, b, c) == (0, 1, 2)
    t.append(b, [8, 9, 10])
    assert t.array[a, :2].tolist() == [5, 6]
    assert t.array[b, :4].tolist() == [7, 8, 9, 10]
    assert t.array[c, :3].tolist() == [1, 2, 3]
    assert t.lengths[[a, b, c]].tolist() == [2, 4, 3]
    t.remove(b)
    d = t.add([4])
    assert d == b and t.lengths[d] == 1 and t.array[d, 0] == 4
    assert t.array.dtype == np.int32


def test_extend_appends_each_rows_blocks_in_one_scatter():
    t = BlockTableArray(rows=4, cols=2)
    a, b, c = t.add([5]), t.add([6, 7]), t.add([8])
    # b gets none, c three (past the table's width: it grows), a one; rows in any order
    t.extend(np.array([c, b, a]), np.array([3, 0, 1]), np.array([30, 31, 32, 10], np.int32))
    assert t.array[a, :2].tolist() == [5, 10]
    assert t.array[b, :2].tolist() == [6, 7]
    assert t.array[c, :4].tolist() == [8, 30, 31, 32]
    assert t.lengths[[a, b, c]].tolist() == [2, 2, 4]
