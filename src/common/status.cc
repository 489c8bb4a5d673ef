#include "eplbx/status.h"

namespace eplbx {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kOutOfRange:
      return "out_of_range";
    case Code::kMismatch:
      return "mismatch";
    case Code::kNotFound:
      return "not_found";
    case Code::kIoError:
      return "io_error";
    case Code::kCorruption:
      return "corruption";
    case Code::kTimeout:
      return "timeout";
    case Code::kAborted:
      return "aborted";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kInProgress:
      return "in_progress";
    case Code::kNotSupported:
      return "not_supported";
    case Code::kInternal:
      return "internal";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out(CodeName(code_));
  if (!message_.empty()) out += ": " + message_;
  return out;
}

Status Status::WithPrefix(std::string_view prefix) const {
  if (ok()) return *this;
  return Status(code_, std::string(prefix) + ": " + message_);
}

}  // namespace eplbx
