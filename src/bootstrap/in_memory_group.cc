// InMemoryGroup: an all-gather among threads of one process (tests, single-process tools).
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>

#include "common/strings.h"
#include "eplbx/bootstrap.h"

namespace eplbx {

using internal::StrCat;

struct InMemoryGroup::Shared {
  std::mutex mu;
  std::condition_variable cv;
  uint32_t size = 0;
  uint64_t round = 0;
  std::vector<std::optional<std::string>> pending;
  std::map<uint64_t, std::vector<std::string>> done;  // round -> result
  std::map<uint64_t, uint32_t> taken;
};

namespace {

class InMemoryMember final : public Bootstrap {
 public:
  InMemoryMember(std::shared_ptr<InMemoryGroup::Shared> g, uint32_t rank)
      : g_(std::move(g)), rank_(rank) {}
  uint32_t rank() const override { return rank_; }
  uint32_t size() const override;
  Result<std::vector<std::string>> AllGather(std::string_view mine,
                                             std::chrono::milliseconds timeout) override;

 private:
  std::shared_ptr<InMemoryGroup::Shared> g_;
  uint32_t rank_;
  uint64_t next_round_ = 0;
};

}  // namespace

InMemoryGroup::InMemoryGroup(uint32_t size) : shared_(std::make_shared<Shared>()) {
  shared_->size = size;
  shared_->pending.resize(size);
}
InMemoryGroup::~InMemoryGroup() = default;
std::unique_ptr<Bootstrap> InMemoryGroup::Member(uint32_t rank) {
  return std::make_unique<InMemoryMember>(shared_, rank);
}

uint32_t InMemoryMember::size() const { return g_->size; }

Result<std::vector<std::string>> InMemoryMember::AllGather(std::string_view mine,
                                                           std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(g_->mu);
  const uint64_t round = next_round_++;
  if (!g_->cv.wait_for(lock, timeout, [&] { return g_->round == round; })) {
    return Status::Timeout(
        StrCat("rank ", rank_, ": all-gather round ", round, " did not start in time"));
  }
  g_->pending[rank_] = std::string(mine);
  if (std::all_of(g_->pending.begin(), g_->pending.end(),
                  [](const auto& p) { return p.has_value(); })) {
    std::vector<std::string> all;
    for (auto& p : g_->pending) all.push_back(std::move(*p)), p.reset();
    g_->done[round] = std::move(all);
    ++g_->round;
    g_->cv.notify_all();
  }
  if (!g_->cv.wait_for(lock, timeout, [&] { return g_->done.count(round) != 0; })) {
    for (uint32_t r = 0; r < g_->size; ++r) {
      if (!g_->pending[r])
        return Status::Timeout(
            StrCat("rank ", rank_, ": all-gather: rank ", r, " did not join in time"));
    }
    return Status::Timeout(StrCat("rank ", rank_, ": all-gather timed out"));
  }
  std::vector<std::string> result = g_->done[round];
  if (++g_->taken[round] == g_->size) {
    g_->done.erase(round);
    g_->taken.erase(round);
  }
  return result;
}

}  // namespace eplbx
