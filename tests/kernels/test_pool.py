"""The kernels' thread pool (pool.cpp): results bitwise the same whatever thread calls a kernel and
however many threads it runs on, more than the machine's cores included; a chunk claimed by any
thread computes the same bits."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from specdec import kernels
from specdec.kernels import packing

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")


def _packed(fmt: str, out_features: int, in_features: int) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(11))
    if fmt == "q4":
        return packing.pack_q4(*packing.quantize_q4(weight))
    return packing.pack_q8(*packing.quantize_q8(weight))


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _in_thread(fn):
    """fn() run in a new thread (as a server's scheduler thread runs the model)."""
    out, errors = [], []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001  re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_products_are_bitwise_the_same_from_any_thread_and_thread_count(isa: str, fmt: str) -> None:
    out_features, in_features = 3072, 576  # 192 units: many chunks for every thread count
    packed = _packed(fmt, out_features, in_features)
    product = kernels.q4_matmul if fmt == "q4" else kernels.q8_matmul
    x = 2 * torch.randn(23, in_features, generator=torch.Generator().manual_seed(12))
    want = _with_threads(1, lambda: product(x, packed, out_features, isa))
    for threads in (2, 3, 5):  # 5: more threads than this machine's cores
        assert torch.equal(_with_threads(threads, lambda: product(x, packed, out_features, isa)), want), threads
        assert torch.equal(_in_thread(lambda: _with_threads(threads, lambda: product(x, packed, out_features, isa))),
                           want), threads


def test_attention_is_bitwise_the_same_from_any_thread_and_thread_count(isa: str) -> None:
    gen = torch.Generator().manual_seed(13)
    rows, heads, kv_heads, nq, slots, head_dim = 2, 9, 3, 7, 40, 64
    q = torch.randn(rows, heads, nq, head_dim, generator=gen)
    keys = torch.randn(rows, kv_heads, slots, head_dim, generator=gen)
    values = torch.randn(rows, kv_heads, slots, head_dim, generator=gen)
    counts = torch.tensor([[30 + i for i in range(nq)], [20 + i for i in range(nq)]], dtype=torch.int32)
    attend = lambda: kernels.attend_cached(q, keys, values, counts, None, None, isa)  # noqa: E731
    want = _with_threads(1, attend)
    for threads in (2, 3, 5):
        assert torch.equal(_with_threads(threads, attend), want), threads
        assert torch.equal(_in_thread(lambda: _with_threads(threads, attend)), want), threads


def _product_in_child(packed: torch.Tensor, x: torch.Tensor, want: torch.Tensor, isa: str, done) -> None:
    torch.set_num_threads(2)
    done.put(bool(torch.equal(kernels.q4_matmul(x, packed, 3072, isa), want)))


def test_a_forked_child_runs_the_kernels_after_its_parent_did(isa: str) -> None:
    # The parent's workers do not exist in a child (a DataLoader's, say): its products finish, on
    # two threads, with the parent's bits. (A lock a worker held at the fork, which the child's
    # fresh pool avoids, is a window too narrow to hit here.)
    packed = _packed("q4", 3072, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(14))
    want = _with_threads(2, lambda: kernels.q4_matmul(x, packed, 3072, isa))  # the parent's pool has run
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_product_in_child, args=(packed, x, want, isa, done))
    child.start()
    child.join(60)
    assert child.exitcode == 0, "the child hung or failed"
    assert done.get(timeout=5) is True


def test_torch_ops_inline_lowers_torch_alone_and_restores_it(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where OpenMP's spinning is unbounded (torch imported first), torch's own operations between
    # passes run on one thread while a kernel call keeps the thread count it had; after the block
    # (an exception included) both are as before, and a thread that never entered one is untouched.
    from specdec import _openmp

    ops = kernels.load()
    monkeypatch.setattr(_openmp, "spin_bounded", True)
    assert _with_threads(3, lambda: _inline_counts(ops)) == (3, 3)  # bounded: nothing to do
    monkeypatch.setattr(_openmp, "spin_bounded", False)

    def inside() -> tuple[int, int, int, int]:
        with kernels.torch_ops_inline():
            seen = torch.get_num_threads(), ops.kernel_threads(), _in_thread(lambda: ops.kernel_threads())
        return (*seen, ops.kernel_threads())

    def after_raising() -> tuple[int, int]:
        with pytest.raises(KeyError):
            with kernels.torch_ops_inline():
                raise KeyError("inside")
        return torch.get_num_threads(), ops.kernel_threads()

    torch_threads, kernel_threads, elsewhere, after = _with_threads(3, inside)
    assert (torch_threads, kernel_threads, after) == (1, 3, 3)
    assert elsewhere == max(1, torch.get_num_threads())  # another thread: torch's own count
    assert _with_threads(3, after_raising) == (3, 3)
    packed = _packed("q8", 64, 64)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    want = _with_threads(1, lambda: kernels.q8_matmul(x, packed, 64, isa))
    with kernels.torch_ops_inline():
        assert torch.equal(kernels.q8_matmul(x, packed, 64, isa), want)


def _inline_counts(ops) -> tuple[int, int]:
    with kernels.torch_ops_inline():
        return torch.get_num_threads(), ops.kernel_threads()
