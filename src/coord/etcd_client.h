// A client for etcd's v3 API through its JSON gateway (HTTP/1.1 + JSON, part of every etcd
// server since 3.3), on libcurl (docs/deploy.md, "Coordination on etcd").
//
// Why the gateway and not gRPC: it is the same API, served by the same process, and needs
// only libcurl and a JSON parser (both in Debian) instead of generated protocol code; the
// calls eplbx makes are few and small (puts, ranges, compare-and-swap transactions, leases),
// so the gateway's cost (JSON, base64) is negligible next to a round trip.
//
// Every call has a deadline; a member that does not answer (down, partitioned, not the
// leader any more) is skipped for the next endpoint until the deadline. Responses are
// bounded and parsed strictly: anything malformed is kCorruption naming the endpoint and
// the field. Thread safe (one request at a time per client).
#ifndef EPLBX_COORD_ETCD_CLIENT_H_
#define EPLBX_COORD_ETCD_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "eplbx/status.h"

namespace eplbx::coord {

struct EtcdKv {
  std::string key, value;
  int64_t create_revision = 0, mod_revision = 0, version = 0, lease = 0;
};

struct EtcdRange {
  int64_t revision = 0;  // the store's revision when it was read
  std::vector<EtcdKv> kvs;
  bool more = false;  // a limit cut it short
};

// One comparison of a transaction: `key`'s target against `value` / `number`.
struct EtcdCompare {
  enum class Target { kVersion, kCreateRevision, kModRevision, kValue };
  enum class Op { kEqual, kNotEqual, kLess, kGreater };
  std::string key;
  Target target = Target::kVersion;
  Op op = Op::kEqual;
  int64_t number = 0;
  std::string value;
};

// One operation of a transaction branch.
struct EtcdOp {
  enum class Kind { kPut, kDelete, kRange };
  Kind kind = Kind::kPut;
  std::string key, value;
  std::string range_end;  // kDelete / kRange: [key, range_end); empty: the key alone
  int64_t lease = 0;
};

// The comparisons and operations eplbx uses, spelled out.
inline EtcdCompare VersionIs(std::string key, int64_t version) {
  return {std::move(key), EtcdCompare::Target::kVersion, EtcdCompare::Op::kEqual, version, {}};
}
inline EtcdCompare VersionAbove(std::string key, int64_t version) {
  return {std::move(key), EtcdCompare::Target::kVersion, EtcdCompare::Op::kGreater, version, {}};
}
inline EtcdCompare ModRevisionIs(std::string key, int64_t revision) {
  return {std::move(key), EtcdCompare::Target::kModRevision, EtcdCompare::Op::kEqual, revision, {}};
}
inline EtcdOp PutOp(std::string key, std::string value, int64_t lease = 0) {
  return {EtcdOp::Kind::kPut, std::move(key), std::move(value), {}, lease};
}
inline EtcdOp RangeOp(std::string key, std::string range_end = {}) {
  return {EtcdOp::Kind::kRange, std::move(key), {}, std::move(range_end), 0};
}
inline EtcdOp DeleteOp(std::string key, std::string range_end = {}) {
  return {EtcdOp::Kind::kDelete, std::move(key), {}, std::move(range_end), 0};
}

struct EtcdTxnResult {
  bool succeeded = false;
  int64_t revision = 0;
  std::vector<EtcdRange> ranges;  // one per kRange op of the branch taken, in order
};

// The gateway's answers, parsed strictly (exposed for the fuzz target): a range, a
// transaction. kCorruption naming `where` and the field on anything malformed.
Result<EtcdRange> ParseRangeResponse(std::string_view body, const std::string& where);
Result<EtcdTxnResult> ParseTxnResponse(std::string_view body, const std::string& where);
// One message of a watch's stream.
struct EtcdWatchMessage {
  bool created = false;   // the watch's creation: `revision` is the store's then
  bool changed = false;   // events: `revision` is the last event's
  bool canceled = false;  // etcd ended the watch
  int64_t revision = 0;
};
// {"result": {...}} parsed strictly (exposed for the fuzz target); kCorruption naming `where`
// and the field, kUnavailable for the gateway's {"error": ...}.
Result<EtcdWatchMessage> ParseWatchMessage(std::string_view line, const std::string& where);

// The end of the range of keys that start with `prefix` (etcd's convention).
std::string PrefixEnd(std::string_view prefix);
std::string Base64Encode(std::string_view bytes);
// kCorruption on anything that is not canonical base64.
Result<std::string> Base64Decode(std::string_view text);

class EtcdClient {
 public:
  // `endpoints`: "host:port" (or "http://host:port") of the cluster's members; at least one.
  static Result<std::unique_ptr<EtcdClient>> Create(std::vector<std::string> endpoints,
                                                    std::chrono::milliseconds request_timeout);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  Result<int64_t> Put(std::string_view key, std::string_view value, int64_t lease = 0);
  // [key, range_end); empty range_end: the key alone. `limit` 0: no limit.
  Result<EtcdRange> Range(std::string_view key, std::string_view range_end = {}, int64_t limit = 0);
  Result<EtcdRange> Prefix(std::string_view prefix) { return Range(prefix, PrefixEnd(prefix)); }
  Result<int64_t> Delete(std::string_view key, std::string_view range_end = {});
  Result<EtcdTxnResult> Txn(const std::vector<EtcdCompare>& compare,
                            const std::vector<EtcdOp>& success,
                            const std::vector<EtcdOp>& failure = {});
  // A lease of `ttl_s` seconds (etcd may grant more: its minimum); returns its id.
  Result<int64_t> LeaseGrant(int64_t ttl_s);
  // Renews lease `id`; returns the seconds it now has. kNotFound when it expired.
  Result<int64_t> LeaseKeepAlive(int64_t id);
  Status LeaseRevoke(int64_t id);
  // Whether the member answering (the current endpoint) is the cluster's leader.
  Result<bool> IsLeader();
  // Watches [key, range_end) from now on: calls `on` for each message of the stream (its
  // creation first) until `on` returns false, StopWatch() is called, or `max` passes; then
  // OK. kUnavailable when the member does not create the watch within a second or the stream
  // breaks (the next call goes to the next member); kCorruption on a malformed message. One
  // watch at a time, on a connection of its own.
  Status Watch(std::string_view key, std::string_view range_end,
               const std::function<bool(const EtcdWatchMessage&)>& on,
               std::chrono::milliseconds max);
  // Ends the watch under way, and any later one at once (thread safe).
  void StopWatch();

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // The endpoint the last request went to (for messages).
  std::string current() const;

  // Largest response accepted (a range of every key under a group's prefix is far smaller).
  static constexpr size_t kMaxResponseBytes = 64u << 20;

 private:
  EtcdClient(std::vector<std::string> endpoints, std::chrono::milliseconds timeout);
  // POSTs `body` to `path` on the current endpoint, moving on to the next one on a
  // connection failure, a timeout or an unavailable member, until the deadline. Returns the
  // response body of a 200 answer; an etcd error answer is a status naming its message.
  Result<std::string> Post(std::string_view path, const std::string& body);

  std::vector<std::string> endpoints_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  size_t at_ = 0;         // the endpoint in use
  void* curl_ = nullptr;  // CURL*, reused (keeps the connection)
  std::mutex watch_mu_;
  void* watch_curl_ = nullptr;   // CURL* of Watch
  void* watch_multi_ = nullptr;  // CURLM* (a wait StopWatch can interrupt)
  std::atomic<bool> watch_stopped_{false};
};

}  // namespace eplbx::coord

#endif  // EPLBX_COORD_ETCD_CLIENT_H_
