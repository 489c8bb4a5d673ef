#include "coord/etcd_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/strings.h"

namespace eplbx::coord {

using internal::StrCat;
namespace {

using nlohmann::json;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// libcurl's global state, once per process.
struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};

// Makes `c` POST `body` to `url`, handing the answer to `write(data)`: plain HTTP only, no
// redirects, no signals, no Nagle.
void SetUpPost(CURL* c, const std::string& url, const std::string& body, curl_write_callback write,
               void* data) {
  curl_easy_reset(c);
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POST, 1L);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, write);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, data);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
#if LIBCURL_VERSION_NUM >= 0x075500  // 7.85: the string form
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http");
#else
  curl_easy_setopt(c, CURLOPT_PROTOCOLS, static_cast<long>(CURLPROTO_HTTP));
#endif
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
}

// A watch's stream, read line by line until a message reports a change.
struct WatchStream {
  std::string where, line;
  const std::function<bool(const EtcdWatchMessage&)>* on = nullptr;
  bool created = false, done = false;
  Status error;
};

size_t OnWatchData(char* data, size_t size, size_t n, void* out) {
  auto* w = static_cast<WatchStream*>(out);
  const std::string_view in(data, size * n);
  for (size_t at = 0; at < in.size();) {
    const size_t nl = std::min(in.find('\n', at), in.size());
    w->line.append(in.substr(at, nl - at));
    if (w->line.size() > EtcdClient::kMaxResponseBytes) {
      w->error = Status::Corruption(
          StrCat(w->where, ": a watch message over ", EtcdClient::kMaxResponseBytes, " bytes"));
      return 0;
    }
    if (nl == in.size()) break;
    at = nl + 1;
    Result<EtcdWatchMessage> m = ParseWatchMessage(w->line, w->where);
    w->line.clear();
    if (!m.ok()) {
      w->error = m.status();
      return 0;  // curl ends the transfer (CURLE_WRITE_ERROR)
    }
    w->created = w->created || m->created;
    if (!(*w->on)(*m) || m->canceled) {
      w->done = true;
      return 0;
    }
  }
  return size * n;
}

size_t Collect(char* data, size_t size, size_t n, void* out) {
  auto* s = static_cast<std::string*>(out);
  if (s->size() + size * n > EtcdClient::kMaxResponseBytes) return 0;  // curl fails the transfer
  s->append(data, size * n);
  return size * n;
}

// etcd's gateway writes int64 fields as JSON strings and leaves out zero values.
Result<int64_t> Int(const json& j, const char* field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return int64_t{0};
  try {
    if (it->is_string()) {
      size_t used = 0;
      const std::string& s = it->get_ref<const std::string&>();
      const long long v = std::stoll(s, &used);
      if (used != s.size()) throw std::invalid_argument(s);
      return static_cast<int64_t>(v);
    }
    if (it->is_number_integer()) return it->get<int64_t>();
  } catch (const std::exception&) {
  }
  return Status::Corruption(
      StrCat(where, ": field '", field, "' is not an integer: ", it->dump().substr(0, 64)));
}

Result<std::string> Bytes(const json& j, const char* field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return std::string();
  if (!it->is_string())
    return Status::Corruption(StrCat(where, ": field '", field, "' is not a base64 string"));
  Result<std::string> b = Base64Decode(it->get_ref<const std::string&>());
  if (!b.ok()) return b.status().WithPrefix(StrCat(where, ": field '", field, "'"));
  return b;
}

Result<EtcdRange> ParseRange(const json& j, const std::string& where) {
  EtcdRange r;
  if (!j.is_object()) return Status::Corruption(StrCat(where, ": a range answer is not an object"));
  if (auto h = j.find("header"); h != j.end()) {
    EPLBX_ASSIGN_OR_RETURN(r.revision, Int(*h, "revision", where));
  }
  if (auto kvs = j.find("kvs"); kvs != j.end()) {
    if (!kvs->is_array()) return Status::Corruption(StrCat(where, ": 'kvs' is not an array"));
    for (const json& kv : *kvs) {
      if (!kv.is_object()) return Status::Corruption(StrCat(where, ": a kv is not an object"));
      EtcdKv x;
      EPLBX_ASSIGN_OR_RETURN(x.key, Bytes(kv, "key", where));
      EPLBX_ASSIGN_OR_RETURN(x.value, Bytes(kv, "value", where));
      EPLBX_ASSIGN_OR_RETURN(x.create_revision, Int(kv, "create_revision", where));
      EPLBX_ASSIGN_OR_RETURN(x.mod_revision, Int(kv, "mod_revision", where));
      EPLBX_ASSIGN_OR_RETURN(x.version, Int(kv, "version", where));
      EPLBX_ASSIGN_OR_RETURN(x.lease, Int(kv, "lease", where));
      r.kvs.push_back(std::move(x));
    }
  }
  if (auto more = j.find("more"); more != j.end()) r.more = more->is_boolean() && more->get<bool>();
  return r;
}

json OpJson(const EtcdOp& op) {
  json body = {{"key", Base64Encode(op.key)}};
  switch (op.kind) {
    case EtcdOp::Kind::kPut:
      body["value"] = Base64Encode(op.value);
      if (op.lease != 0) body["lease"] = std::to_string(op.lease);
      return {{"request_put", body}};
    case EtcdOp::Kind::kDelete:
      if (!op.range_end.empty()) body["range_end"] = Base64Encode(op.range_end);
      return {{"request_delete_range", body}};
    case EtcdOp::Kind::kRange:
      if (!op.range_end.empty()) body["range_end"] = Base64Encode(op.range_end);
      return {{"request_range", body}};
  }
  return {};
}

}  // namespace

Result<EtcdRange> ParseRangeResponse(std::string_view body, const std::string& where) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(StrCat(where, ": not a JSON object"));
  return ParseRange(j, where);
}

Result<EtcdTxnResult> ParseTxnResponse(std::string_view body, const std::string& where) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(StrCat(where, ": not a JSON object"));
  EtcdTxnResult r;
  auto ok = j.find("succeeded");
  r.succeeded = ok != j.end() && ok->is_boolean() && ok->get<bool>();
  auto header = j.find("header");
  if (header != j.end() && !header->is_object())
    return Status::Corruption(StrCat(where, ": 'header' is not an object"));
  if (header != j.end()) {
    EPLBX_ASSIGN_OR_RETURN(r.revision, Int(*header, "revision", where));
  }
  if (auto rs = j.find("responses"); rs != j.end()) {
    if (!rs->is_array()) return Status::Corruption(StrCat(where, ": 'responses' is not an array"));
    for (const json& x : *rs) {
      if (!x.is_object()) return Status::Corruption(StrCat(where, ": a response is not an object"));
      if (auto range = x.find("response_range"); range != x.end()) {
        EPLBX_ASSIGN_OR_RETURN(EtcdRange got, ParseRange(*range, where));
        r.ranges.push_back(std::move(got));
      }
    }
  }
  return r;
}

Result<EtcdWatchMessage> ParseWatchMessage(std::string_view line, const std::string& where) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(StrCat(where, ": a watch message is not JSON"));
  auto result = j.find("result");
  if (result == j.end() || !result->is_object()) {
    // The gateway reports a failed stream as {"error": {...}}.
    auto error = j.find("error");
    std::string message = "no 'result'";
    if (error != j.end() && error->is_object() && error->contains("message") &&
        (*error)["message"].is_string()) {
      message = (*error)["message"].get<std::string>().substr(0, 200);
    }
    return Status::Unavailable(StrCat(where, ": watch ended: ", message));
  }
  EtcdWatchMessage m;
  if (auto h = result->find("header"); h != result->end()) {
    if (!h->is_object()) return Status::Corruption(StrCat(where, ": 'header' is not an object"));
    EPLBX_ASSIGN_OR_RETURN(m.revision, Int(*h, "revision", where));
  }
  auto flag = [&](const char* field) {
    auto it = result->find(field);
    return it != result->end() && it->is_boolean() && it->get<bool>();
  };
  m.created = flag("created");
  m.canceled = flag("canceled");
  if (auto events = result->find("events"); events != result->end()) {
    if (!events->is_array()) return Status::Corruption(StrCat(where, ": 'events' is not an array"));
    for (const json& e : *events) {
      auto kv = e.is_object() ? e.find("kv") : e.end();
      if (kv == e.end() || !kv->is_object())
        return Status::Corruption(StrCat(where, ": an event without its 'kv'"));
      EPLBX_ASSIGN_OR_RETURN(int64_t rev, Int(*kv, "mod_revision", where));
      m.changed = true;
      m.revision = std::max(m.revision, rev);
    }
  }
  if (m.revision < 0) return Status::Corruption(StrCat(where, ": a negative revision"));
  return m;
}

std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

std::string Base64Encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const uint32_t v = (static_cast<uint8_t>(in[i]) << 16) |
                       (static_cast<uint8_t>(in[i + 1]) << 8) | static_cast<uint8_t>(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view in) {
  std::array<int, 256> value;
  value.fill(-1);
  for (int i = 0; i < 64; ++i) value[static_cast<uint8_t>(kAlphabet[i])] = i;
  if (in.size() % 4 != 0)
    return Status::Corruption(StrCat("base64 of ", in.size(), " characters (not a multiple of 4)"));
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    int pad = 0;
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = in[i + k];
      if (c == '=' && last && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      if (pad > 0 || value[static_cast<uint8_t>(c)] < 0)
        return Status::Corruption(StrCat("base64 character ", i + k, " is not valid"));
      v = (v << 6) | static_cast<uint32_t>(value[static_cast<uint8_t>(c)]);
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return out;
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, std::chrono::milliseconds timeout)
    : endpoints_(std::move(endpoints)), timeout_(timeout) {}

EtcdClient::~EtcdClient() {
  if (curl_ != nullptr) curl_easy_cleanup(static_cast<CURL*>(curl_));
  if (watch_curl_ != nullptr) curl_easy_cleanup(static_cast<CURL*>(watch_curl_));
  if (watch_multi_ != nullptr) curl_multi_cleanup(static_cast<CURLM*>(watch_multi_));
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::Create(std::vector<std::string> endpoints,
                                                       std::chrono::milliseconds request_timeout) {
  static CurlGlobal global;
  if (endpoints.empty()) return Status::InvalidArgument("etcd: no endpoints");
  for (std::string& e : endpoints) {
    if (e.rfind("http://", 0) == 0) e = e.substr(7);
    const size_t colon = e.rfind(':');
    if (e.empty() || colon == std::string::npos || colon == 0 || colon + 1 == e.size() ||
        e.find_first_of("/?#@ \t") != std::string::npos) {
      return Status::InvalidArgument(
          StrCat("etcd: endpoint '", e, "' is not HOST:PORT (e.g. 127.0.0.1:2379)"));
    }
  }
  if (request_timeout.count() <= 0)
    return Status::InvalidArgument("etcd: the request timeout must be positive");
  std::unique_ptr<EtcdClient> c(new EtcdClient(std::move(endpoints), request_timeout));
  c->curl_ = curl_easy_init();
  c->watch_curl_ = curl_easy_init();
  c->watch_multi_ = curl_multi_init();
  if (c->curl_ == nullptr || c->watch_curl_ == nullptr || c->watch_multi_ == nullptr)
    return Status::Internal("etcd: curl_easy_init failed");
  return c;
}

std::string EtcdClient::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return endpoints_[at_];
}

Result<std::string> EtcdClient::Post(std::string_view path, const std::string& body) {
  std::lock_guard<std::mutex> lock(mu_);
  CURL* c = static_cast<CURL*>(curl_);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::string failures;
  for (int attempt = 0;; ++attempt) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline && attempt > 0) {
      return Status::Unavailable(StrCat("etcd: no member answered ", path, " within ",
                                        timeout_.count(), " ms (", failures, ")"));
    }
    const std::string& endpoint = endpoints_[at_];
    const std::string url = StrCat("http://", endpoint, path);
    const long left_ms = std::max<long>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count());
    std::string response;
    SetUpPost(c, url, body, &Collect, &response);
    // One member may hold a request through an election: give each its share of the time.
    const long share = std::max<long>(
        300, static_cast<long>(timeout_.count() / static_cast<long>(endpoints_.size())));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, std::min<long>(left_ms, share));
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(left_ms, 1000));
    const CURLcode rc = curl_easy_perform(c);
    long http = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
    std::string why;
    if (rc != CURLE_OK) {
      why = curl_easy_strerror(rc);
    } else if (http == 200) {
      return response;
    } else {
      // etcd's error answer: {"error", "code", "message"}.
      json j = json::parse(response, nullptr, /*allow_exceptions=*/false);
      std::string message = j.is_object() && j.contains("message") && j["message"].is_string()
                                ? j["message"].get<std::string>()
                                : response.substr(0, 200);
      const int code = j.is_object() && j.contains("code") && j["code"].is_number_integer()
                           ? j["code"].get<int>()
                           : -1;
      // gRPC codes: 5 not found, 3 invalid argument, 9 failed precondition; 14 unavailable
      // and 4 deadline exceeded (no leader, leader changed) go to the next member.
      if (code == 5) return Status::NotFound(StrCat("etcd ", endpoint, ": ", message));
      if (code != 14 && code != 4 && http < 500) {
        return Status::InvalidArgument(
            StrCat("etcd ", endpoint, " refused ", path, " (HTTP ", http, "): ", message));
      }
      why = StrCat("HTTP ", http, ": ", message);
    }
    if (!failures.empty()) failures += "; ";
    failures += StrCat(endpoint, ": ", why);
    at_ = (at_ + 1) % endpoints_.size();
    if (attempt + 1 >= static_cast<int>(endpoints_.size())) {
      // Every member tried once: wait a little (an election takes a moment) and go round.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

Result<int64_t> EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) {
  json body = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/kv/put", body.dump()));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object()) return Status::Corruption(StrCat("etcd ", current(), ": put: not JSON"));
  return Int(j.value("header", json::object()), "revision", "etcd put");
}

Result<EtcdRange> EtcdClient::Range(std::string_view key, std::string_view range_end,
                                    int64_t limit) {
  json body = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) body["range_end"] = Base64Encode(range_end);
  if (limit > 0) body["limit"] = std::to_string(limit);
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/kv/range", body.dump()));
  return ParseRangeResponse(out, StrCat("etcd ", current(), " range"));
}

Result<int64_t> EtcdClient::Delete(std::string_view key, std::string_view range_end) {
  json body = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) body["range_end"] = Base64Encode(range_end);
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/kv/deleterange", body.dump()));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object()) return Status::Corruption(StrCat("etcd ", current(), ": delete: not JSON"));
  return Int(j, "deleted", "etcd delete");
}

Result<EtcdTxnResult> EtcdClient::Txn(const std::vector<EtcdCompare>& compare,
                                      const std::vector<EtcdOp>& success,
                                      const std::vector<EtcdOp>& failure) {
  static const char* kTargets[] = {"VERSION", "CREATE", "MOD", "VALUE"};
  static const char* kOps[] = {"EQUAL", "NOT_EQUAL", "LESS", "GREATER"};
  json cmp = json::array();
  for (const EtcdCompare& c : compare) {
    json x = {{"key", Base64Encode(c.key)},
              {"target", kTargets[static_cast<int>(c.target)]},
              {"result", kOps[static_cast<int>(c.op)]}};
    switch (c.target) {
      case EtcdCompare::Target::kVersion:
        x["version"] = std::to_string(c.number);
        break;
      case EtcdCompare::Target::kCreateRevision:
        x["create_revision"] = std::to_string(c.number);
        break;
      case EtcdCompare::Target::kModRevision:
        x["mod_revision"] = std::to_string(c.number);
        break;
      case EtcdCompare::Target::kValue:
        x["value"] = Base64Encode(c.value);
        break;
    }
    cmp.push_back(std::move(x));
  }
  json ok = json::array(), otherwise = json::array();
  for (const EtcdOp& op : success) ok.push_back(OpJson(op));
  for (const EtcdOp& op : failure) otherwise.push_back(OpJson(op));
  json body = {{"compare", cmp}, {"success", ok}, {"failure", otherwise}};
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/kv/txn", body.dump()));
  return ParseTxnResponse(out, StrCat("etcd ", current(), " txn"));
}

Status EtcdClient::Watch(std::string_view key, std::string_view range_end,
                         const std::function<bool(const EtcdWatchMessage&)>& on,
                         std::chrono::milliseconds max) {
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (watch_stopped_) return Status::OK();
  CURL* c = static_cast<CURL*>(watch_curl_);
  CURLM* m = static_cast<CURLM*>(watch_multi_);
  const std::string endpoint = current();
  const std::string url = StrCat("http://", endpoint, "/v3/watch");
  json create = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) create["range_end"] = Base64Encode(range_end);
  const std::string body = json{{"create_request", create}}.dump();
  WatchStream stream;
  stream.where = StrCat("etcd ", endpoint, " watch");
  stream.on = &on;
  SetUpPost(c, url, body, &OnWatchData, &stream);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 1000L);
  curl_multi_add_handle(m, c);
  const auto start = std::chrono::steady_clock::now();
  bool silent = false;  // connected, but no creation within a second: a member stopped
  bool expired = false;
  for (int running = 1; running != 0;) {
    curl_multi_perform(m, &running);
    if (running == 0 || watch_stopped_) break;
    const auto took = std::chrono::steady_clock::now() - start;
    if ((expired = took >= max)) break;
    if (!stream.created && took >= std::chrono::seconds(1)) {
      silent = true;
      break;
    }
    curl_multi_poll(m, nullptr, 0, 200, nullptr);
  }
  CURLcode rc = CURLE_OK;
  int left = 0;
  while (CURLMsg* msg = curl_multi_info_read(m, &left)) {
    if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
  }
  long http = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
  curl_multi_remove_handle(m, c);
  if (!stream.error.ok()) return stream.error;
  if (stream.done || watch_stopped_ || (expired && stream.created)) return Status::OK();
  // The stream ended, never started, or stayed silent: the member went away.
  {
    std::lock_guard<std::mutex> l(mu_);
    if (endpoints_[at_] == endpoint) at_ = (at_ + 1) % endpoints_.size();
  }
  const std::string why = silent           ? std::string("no answer within a second")
                          : rc != CURLE_OK ? std::string(curl_easy_strerror(rc))
                                           : StrCat("the stream ended (HTTP ", http, ")");
  return Status::Unavailable(StrCat(stream.where, ": ", why));
}

void EtcdClient::StopWatch() {
  watch_stopped_ = true;
  curl_multi_wakeup(static_cast<CURLM*>(watch_multi_));
}

Result<int64_t> EtcdClient::LeaseGrant(int64_t ttl_s) {
  json body = {{"TTL", std::to_string(ttl_s)}};
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/lease/grant", body.dump()));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object())
    return Status::Corruption(StrCat("etcd ", current(), ": lease grant: not JSON"));
  EPLBX_ASSIGN_OR_RETURN(int64_t id, Int(j, "ID", "etcd lease grant"));
  if (id == 0) return Status::Corruption(StrCat("etcd ", current(), ": lease grant without an ID"));
  return id;
}

Result<int64_t> EtcdClient::LeaseKeepAlive(int64_t id) {
  json body = {{"ID", std::to_string(id)}};
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/lease/keepalive", body.dump()));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object() || !j.contains("result") || !j["result"].is_object())
    return Status::Corruption(StrCat("etcd ", current(), ": lease keepalive: no result"));
  EPLBX_ASSIGN_OR_RETURN(int64_t ttl, Int(j["result"], "TTL", "etcd lease keepalive"));
  if (ttl <= 0) return Status::NotFound(StrCat("etcd: lease ", id, " expired"));
  return ttl;
}

Status EtcdClient::LeaseRevoke(int64_t id) {
  json body = {{"ID", std::to_string(id)}};
  return Post("/v3/lease/revoke", body.dump()).status();
}

Result<bool> EtcdClient::IsLeader() {
  EPLBX_ASSIGN_OR_RETURN(std::string out, Post("/v3/maintenance/status", "{}"));
  json j = json::parse(out, nullptr, false);
  if (!j.is_object()) return Status::Corruption(StrCat("etcd ", current(), ": status: not JSON"));
  // Member ids are unsigned 64-bit: compared as the strings the gateway writes.
  const json header = j.value("header", json::object());
  auto text = [](const json& o, const char* field) {
    auto it = o.is_object() ? o.find(field) : o.end();
    return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const std::string leader = text(j, "leader"), me = text(header, "member_id");
  return !leader.empty() && leader == me;
}

}  // namespace eplbx::coord
