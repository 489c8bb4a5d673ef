// Copyright (c) eplbx authors. The error vocabulary of every eplbx API.
//
// Every fallible function returns Status or Result<T>; no exception crosses the public API.
// The first function that decides on an error writes the context into the message (rank,
// layer, tensor, both values, the likely fix); callers add a prefix, they do not re-log.
//
// Thread safety: Status and Result are values; distinct objects may be used from distinct
// threads freely, one object from several threads only for const access.
#ifndef EPLBX_STATUS_H_
#define EPLBX_STATUS_H_

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace eplbx {

// What the caller should do is implied by the code:
//   kInvalidArgument, kOutOfRange, kMismatch  -> fix the input or configuration;
//   kIoError, kNotFound                       -> fix the file or path;
//   kCorruption                               -> the bytes are damaged or hostile; drop them;
//   kTimeout, kAborted, kUnavailable          -> rebuild the communicator and retry;
//   kInProgress                               -> poll again (asynchronous operations only);
//   kNotSupported                             -> pick another backend or option;
//   kInternal                                 -> a bug in eplbx; please report it.
enum class Code {
  kOk = 0,
  kInvalidArgument,
  kOutOfRange,
  kMismatch,
  kNotFound,
  kIoError,
  kCorruption,
  kTimeout,
  kAborted,
  kUnavailable,
  kInProgress,
  kNotSupported,
  kInternal,
};

// Stable lower-case name of a code ("invalid_argument"), used in messages and bindings.
std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  // OK costs one enum and an empty string (no allocation).
  Status() = default;

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {Code::kInvalidArgument, std::move(msg)};
  }
  static Status OutOfRange(std::string msg) { return {Code::kOutOfRange, std::move(msg)}; }
  static Status Mismatch(std::string msg) { return {Code::kMismatch, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {Code::kNotFound, std::move(msg)}; }
  static Status IoError(std::string msg) { return {Code::kIoError, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {Code::kCorruption, std::move(msg)}; }
  static Status Timeout(std::string msg) { return {Code::kTimeout, std::move(msg)}; }
  static Status Aborted(std::string msg) { return {Code::kAborted, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {Code::kUnavailable, std::move(msg)}; }
  static Status InProgress(std::string msg = {}) { return {Code::kInProgress, std::move(msg)}; }
  static Status NotSupported(std::string msg) { return {Code::kNotSupported, std::move(msg)}; }
  static Status Internal(std::string msg) { return {Code::kInternal, std::move(msg)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // "invalid_argument: <message>", or "ok".
  std::string ToString() const;

  // Returns a copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithPrefix(std::string_view prefix) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}

  Code code_ = Code::kOk;
  std::string message_;
};

// Either a value or a non-OK Status. Outputs hold a value only after success.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  // REQUIRES: !status.ok()
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok());
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result built from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }

  // REQUIRES: ok()
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace eplbx

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define EPLBX_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::eplbx::Status eplbx_status_ = (expr);        \
    if (!eplbx_status_.ok()) return eplbx_status_; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its Status from the enclosing function.
// lhs may declare a variable: EPLBX_ASSIGN_OR_RETURN(Placement p, Plan(...));
#define EPLBX_ASSIGN_OR_RETURN(lhs, expr) \
  EPLBX_ASSIGN_OR_RETURN_IMPL_(EPLBX_CONCAT_(eplbx_result_, __LINE__), lhs, expr)
#define EPLBX_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
#define EPLBX_CONCAT_(a, b) EPLBX_CONCAT_IMPL_(a, b)
#define EPLBX_CONCAT_IMPL_(a, b) a##b

#endif  // EPLBX_STATUS_H_
