#include "eplbx/status.h"

#include <gtest/gtest.h>

namespace eplbx {
namespace {

TEST(StatusTest, OkIsDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), Code::kOk);
  EXPECT_EQ(s.ToString(), "ok");
}

TEST(StatusTest, CarriesCodeAndMessage) {
  Status s = Status::InvalidArgument("slots is 0");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "invalid_argument: slots is 0");
  EXPECT_EQ(s.WithPrefix("plan").message(), "plan: slots is 0");
  EXPECT_TRUE(Status::OK().WithPrefix("x").ok());
}

TEST(StatusTest, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(Code::kInternal); ++c) {
    EXPECT_NE(CodeName(static_cast<Code>(c)), "unknown") << c;
  }
}

Result<int> Half(int v) {
  if (v % 2) return Status::InvalidArgument("odd");
  return v / 2;
}

Status UseHalf(int v, int* out) {
  Result<int> r = Half(v);
  EPLBX_RETURN_IF_ERROR(r.status());
  *out = *r;
  return Status::OK();
}

TEST(ResultTest, ValueOrStatus) {
  EXPECT_EQ(*Half(4), 2);
  EXPECT_EQ(Half(3).status().code(), Code::kInvalidArgument);
  int out = -1;
  EXPECT_FALSE(UseHalf(3, &out).ok());
  EXPECT_EQ(out, -1);  // outputs are set only after success
  EXPECT_TRUE(UseHalf(6, &out).ok());
  EXPECT_EQ(out, 3);
}

}  // namespace
}  // namespace eplbx
