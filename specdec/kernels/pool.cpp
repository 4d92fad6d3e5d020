// The kernels' own thread pool. A kernel's work is a range of independent items (units of 16
// output columns, attention tasks, rows) cut into chunks that the calling thread and the pool's
// workers claim from one shared counter; the call returns when every chunk is done. Nothing waits
// for a thread that has not claimed work: a worker that the OS has descheduled (another process,
// the server's event loop, a client on the same two cores) leaves its share to whoever runs,
// where a fork-join team (OpenMP's static split) stalls each region until it runs again. Which
// thread computes a chunk never changes a bit of it.
//
// Why not OpenMP: libgomp throttles its workers' spinning to almost nothing once a process holds
// more OpenMP threads than the machine has cores, which a second thread that calls torch (a
// server's scheduler thread, after the main thread loaded the model) reaches at once: every
// parallel region then waits out a futex wake-up, several times a small product's own time.
//
// Workers wait SPIN for the next job (a pass's products follow each other microseconds apart),
// pausing, then yielding their core between looks (on a busy machine another process's work
// runs meanwhile), then sleep on a condition variable. One job at a time: a thread that finds
// the pool busy (a second engine in another thread) runs its job alone, as does a job submitted
// from inside a job.

#include "pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace specdec {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto SPIN = std::chrono::microseconds(1000);
constexpr int YIELD_AFTER = 256;          // pauses before a waiting worker starts yielding
constexpr int CALLER_YIELD_AFTER = 2000;  // pauses before a caller waiting for chunks does
constexpr int64_t MAX_CHUNKS = 0xFFFF;

// The job word: generation (32 bits) | chunks (16) | next chunk to claim (16). A claim is a
// compare-and-swap on the whole word, so it can only take a chunk of the job it read.
inline uint64_t gen_of(uint64_t s) { return s >> 32; }
inline int64_t chunks_of(uint64_t s) { return static_cast<int64_t>((s >> 16) & 0xFFFF); }
inline int64_t next_of(uint64_t s) { return static_cast<int64_t>(s & 0xFFFF); }

thread_local bool in_job = false;

class Pool {
   public:
    static Pool& get() {
        // Never destroyed: its workers may be asleep at exit. A forked child has none of its
        // threads, and maybe a lock a worker held: it starts a pool of its own.
        static const bool started = [] {
            current = new Pool();
            pthread_atfork(nullptr, nullptr, [] { current = new Pool(); });
            return true;
        }();
        (void)started;
        return *current;
    }

    void run(int64_t n, int64_t chunk, int threads, const Body& body) {
        std::unique_lock<std::mutex> turn(submit_, std::try_to_lock);
        if (!turn.owns_lock()) {  // another thread's job holds the pool
            body(0, n);
            return;
        }
        grow(threads - 1);
        const int64_t chunks = (n + chunk - 1) / chunk;
        body_ = &body;
        n_ = n;
        chunk_ = chunk;
        wanted_.store(threads - 1, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        error_ = nullptr;
        const uint64_t gen = ++generation_;
        state_.store(gen << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lock(sleep_m_);
            sleep_cv_.notify_all();
        }
        work(gen);
        // The chunks others hold: spin briefly, then give the core away, so that a worker the OS
        // preempted mid-chunk gets it back (on two cores the caller's spinning could be what keeps
        // it off).
        for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
            if (spins < CALLER_YIELD_AFTER) _mm_pause();
            else std::this_thread::yield();
        }
        if (error_) std::rethrow_exception(error_);
    }

   private:
    // Claim and run chunks of generation `gen` until none is left.
    void work(uint64_t gen) {
        uint64_t s = state_.load(std::memory_order_acquire);
        while (gen_of(s) == gen && next_of(s) < chunks_of(s)) {
            if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire))
                continue;
            // The job cannot finish before this chunk is counted done, so its fields are this
            // generation's until then.
            const int64_t begin = next_of(s) * chunk_, end = std::min(n_, begin + chunk_);
            in_job = true;
            try {
                (*body_)(begin, end);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_m_);
                if (!error_) error_ = std::current_exception();
            }
            in_job = false;
            done_.fetch_add(1, std::memory_order_acq_rel);
            s = state_.load(std::memory_order_acquire);
        }
    }

    void grow(int workers) {
        while (static_cast<int>(workers_.size()) < workers) {
            const int index = static_cast<int>(workers_.size());
            workers_.emplace_back([this, index] { loop(index); });
            workers_.back().detach();
        }
    }

    void loop(int index) {
        uint64_t seen = gen_of(state_.load(std::memory_order_acquire));
        for (;;) {
            const auto start = Clock::now();
            for (int spins = 0; gen_of(state_.load(std::memory_order_acquire)) == seen; ++spins) {
                // Pause a while, then give the core to any runnable thread between looks (another
                // process's work, on a busy machine) until SPIN has passed.
                if (spins < YIELD_AFTER) _mm_pause();
                else std::this_thread::yield();
                if (spins % 64 == 0 && Clock::now() - start > SPIN) {
                    std::unique_lock<std::mutex> lock(sleep_m_);
                    sleepers_.fetch_add(1, std::memory_order_seq_cst);
                    sleep_cv_.wait(lock, [&] { return gen_of(state_.load(std::memory_order_seq_cst)) != seen; });
                    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
                    break;
                }
            }
            seen = gen_of(state_.load(std::memory_order_acquire));
            if (index < wanted_.load(std::memory_order_relaxed)) work(seen);
        }
    }

    static inline Pool* current = nullptr;
    std::mutex submit_;
    std::vector<std::thread> workers_;
    uint64_t generation_ = 0;
    std::atomic<uint64_t> state_{0};
    std::atomic<int64_t> done_{0};
    std::atomic<int> wanted_{0};
    std::atomic<int> sleepers_{0};
    std::mutex sleep_m_;
    std::condition_variable sleep_cv_;
    const Body* body_ = nullptr;
    int64_t n_ = 0, chunk_ = 1;
    std::mutex error_m_;
    std::exception_ptr error_;
};

}  // namespace

namespace {
thread_local int held_threads = 0;  // hold_threads' count for this thread; 0: torch's
}  // namespace

int kernel_threads() { return held_threads > 0 ? held_threads : std::max(1, at::get_num_threads()); }

void hold_threads(int threads) { held_threads = std::max(0, threads); }

void parallel_chunks(int64_t n, int64_t grain, const Body& body) {
    if (n <= 0) return;
    const int threads = kernel_threads();
    // Four chunks a thread: a thread that stalls holds up a quarter of its share at most.
    int64_t chunk = std::max<int64_t>({grain, 1, (n + 4 * threads - 1) / (4 * threads)});
    chunk = std::max(chunk, (n + MAX_CHUNKS - 1) / MAX_CHUNKS);
    if (threads == 1 || n <= chunk || in_job) {
        body(0, n);
        return;
    }
    Pool::get().run(n, chunk, threads, body);
}

void parallel_runs(int64_t n, const Body& body) {
    // A product's weights stream from memory, and a stream takes a while to reach full speed
    // (the hardware prefetcher locks on after a few misses; software prefetching starts a few
    // records in): chunks dealt out one by one start a stream at every chunk and leave the last
    // ones' tails unbalanced. A thread preempted before it claims its run still leaves it to the
    // others.
    const int64_t threads = kernel_threads();
    parallel_chunks(n, (n + threads - 1) / threads, body);
}

}  // namespace specdec
