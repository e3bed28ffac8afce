// Sharing a kernel's work out over XLA:CPU's intra-op threads (jrlhf/native/*.cc).

#ifndef JRLHF_NATIVE_SHARE_OUT_H_
#define JRLHF_NATIVE_SHARE_OUT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jrlhf {

// Runs item(i, scratch) for every i in [0, items) on the calling thread and the pool's: items
// are claimed one at a time, so the caller only ever waits for items another thread is already
// working on (never for a task to start), and returns when all are done. `scratch` is a buffer
// each thread keeps across its items. A helper that starts after the last item was claimed
// finds nothing to do (and never touches `item`, which may refer to the caller's frame).
template <typename Item>
void ShareOut(xla::ffi::ThreadPool& pool, int64_t items, Item item) {
  struct Shared {
    Item item;
    int64_t items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Work() {
      std::vector<float> scratch;
      for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
        item(i, scratch);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (items <= 0) return;
  auto shared = std::shared_ptr<Shared>(new Shared{item, items});
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jrlhf

#endif  // JRLHF_NATIVE_SHARE_OUT_H_
