"""tests/matrix.py's shards (FASTFORMER_MATRIX_SHARD=K/N, which CI sets from its commit): every shard checks
every family on every backend and dtype, the N shards together are the whole matrix, and each other case
is in exactly one shard."""
from collections import Counter
from dataclasses import dataclass

import pytest

from matrix import matrix_params, parse_shard


@dataclass(frozen=True)
class Case:
    family: str
    number: int
    dtypes: tuple | None = None
    work: int = 1

    def __str__(self):
        return f"{self.family}-{self.number}"


CASES = [Case(family, number) for family in ("rows", "masks", "long") for number in range(12)]


def ids(params):
    return [p.id for p in params]


def family_cells(params):
    """(backend, dtype, family) of each param."""
    return {(p.values[0], p.values[1], p.values[2].family) for p in params}


def test_the_shards_partition_the_matrix_and_each_keeps_every_family():
    whole = matrix_params("softmax", CASES, None)
    shards = [matrix_params("softmax", CASES, (k, 3)) for k in (1, 2, 3)]
    assert set().union(*map(ids, shards)) == set(ids(whole))
    for shard in shards:
        assert family_cells(shard) == family_cells(whole)
        assert len(shard) < 0.6 * len(whole)
    # the first case of each (backend, dtype, family) is in every shard, every other case in exactly one
    counts = Counter(i for shard in shards for i in ids(shard))
    firsts = {p.id for p in whole if p.values[2].number == 0}
    assert all(counts[i] == 3 for i in firsts)
    assert all(n == 1 for i, n in counts.items() if i not in firsts)


def test_one_shard_of_one_is_the_whole_matrix():
    assert ids(matrix_params("softmax", CASES, (1, 1))) == ids(matrix_params("softmax", CASES, None))


@pytest.mark.parametrize("value", ["3", "0/3", "4/3", "a/b", "1/0", "1/2/3"])
def test_a_bad_shard_is_refused_clearly(value):
    with pytest.raises(ValueError, match="FASTFORMER_MATRIX_SHARD"):
        parse_shard(value)


def test_no_shard_value_means_every_case():
    assert parse_shard(None) is None and parse_shard("") is None and parse_shard("2/5") == (2, 5)
