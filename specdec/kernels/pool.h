// pool.cpp: the kernels' thread pool (see there for why not OpenMP).
#pragma once

#include <cstdint>
#include <functional>

namespace specdec {

using Body = std::function<void(int64_t begin, int64_t end)>;

// body(begin, end) over [0, n) in chunks of at least `grain` items, run by the calling thread
// and the pool's workers, kernel_threads() of them at most; returns when all are done and
// rethrows the first exception a chunk threw. A chunk is whatever thread claims it first.
void parallel_chunks(int64_t n, int64_t grain, const Body& body);

// body over [0, n) as one contiguous run of items per thread, claimed as parallel_chunks' chunks
// are: for a product's weight units, which each thread then reads as one stream.
void parallel_runs(int64_t n, const Body& body);

// The threads a kernel call uses: torch's intra-op thread count as the calling thread sees it
// (torch.set_num_threads, the server's --threads), or the count hold_threads set on this thread.
int kernel_threads();

// Kernel calls from this thread use `threads` whatever torch's own count is (0: torch's again),
// so that torch's operations can run on one thread while specdec's keep theirs.
void hold_threads(int threads);

}  // namespace specdec
