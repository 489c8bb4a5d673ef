// The checkpoint as a backup source (issue 20, item 3c): expert rows read from a safetensors
// file, checked against the layout; truncated or mismatched files are clear errors.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace eplbx::io {
namespace {

std::string U64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A file of `header` (JSON) and `data`.
std::string Write(const std::string& name, const std::string& header, const std::string& data) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << U64(header.size()) << header << data;
  return path;
}

// "layers.0.w13": BF16 [4, 3, 2] (12 bytes per expert; byte i of expert e is e * 16 + i), and
// "layers.0.w2": F32 [4, 2].
std::string Data() {
  std::string d;
  for (int e = 0; e < 4; ++e) {
    for (int i = 0; i < 12; ++i) d += static_cast<char>(e * 16 + i);
  }
  return d + std::string(32, '\x7f');
}
const char* kHeader =
    R"({"__metadata__": {"format": "pt"},
        "layers.0.w13": {"dtype": "BF16", "shape": [4, 3, 2], "data_offsets": [0, 48]},
        "layers.0.w2": {"dtype": "F32", "shape": [4, 2], "data_offsets": [48, 80]}})";

TensorSpec W13() { return {"w13", "bf16", {3, 2}, 0, 12, 4}; }

TEST(SafetensorsTest, ReadsExpertRowsCheckedAgainstTheLayout) {
  Result<SafetensorsFile> f = SafetensorsFile::Open(Write("good.safetensors", kHeader, Data()));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 2u);
  for (uint32_t e = 0; e < 4; ++e) {
    uint8_t row[12];
    ASSERT_TRUE(f->ReadExpertRow("layers.0.w13", e, W13(), row).ok());
    for (int i = 0; i < 12; ++i) EXPECT_EQ(row[i], e * 16 + i);
  }
  uint8_t row[12] = {};
  TensorSpec fp8 = W13();
  fp8.dtype = "fp8_e4m3";
  fp8.bytes_per_expert = 6;
  const Status mismatch = f->ReadExpertRow("layers.0.w13", 1, fp8, row);
  EXPECT_EQ(mismatch.code(), Code::kMismatch);
  EXPECT_NE(mismatch.message().find("tensor 'layers.0.w13' is BF16 [4, 3, 2] (bf16 [3, 2], 12 "
                                    "bytes per expert); the layout's 'w13' is fp8_e4m3 [3, 2], 6 "
                                    "bytes per expert"),
            std::string::npos)
      << mismatch.ToString();
  EXPECT_EQ(row[0], 0);  // nothing written
  TensorSpec shape = W13();
  shape.expert_shape = {2, 3};
  EXPECT_EQ(f->ReadExpertRow("layers.0.w13", 1, shape, row).code(), Code::kMismatch);
  EXPECT_NE(f->ReadExpertRow("layers.0.w13", 4, W13(), row)
                .message()
                .find("has 4 experts; expert 4 is not among them"),
            std::string::npos);
  EXPECT_NE(f->ReadExpertRow("layers.9.w13", 0, W13(), row)
                .message()
                .find("has no tensor 'layers.9.w13' (it has 2 tensors"),
            std::string::npos);
}

TEST(SafetensorsTest, TruncatedAndMalformedFilesAreNamed) {
  const std::string data = Data();
  auto error = [](const std::string& path) { return SafetensorsFile::Open(path).status(); };
  // Truncated inside the second tensor's data.
  Status cut = error(Write("cut.safetensors", kHeader, data.substr(0, 60)));
  EXPECT_EQ(cut.code(), Code::kCorruption);
  EXPECT_NE(cut.message().find("tensor 'layers.0.w2' ends at data byte 80 but the file holds 60 "
                               "bytes of data (truncated?)"),
            std::string::npos)
      << cut.ToString();
  // Truncated inside the header.
  const std::string path = Write("short.safetensors", kHeader, data);
  {
    std::string all;
    std::ifstream in(path, std::ios::binary);
    all.assign(std::istreambuf_iterator<char>(in), {});
    std::ofstream(path, std::ios::binary | std::ios::trunc) << all.substr(0, 40);
  }
  EXPECT_NE(error(path).message().find("truncated?"), std::string::npos) << error(path).ToString();
  EXPECT_NE(error(Write("tiny.safetensors", "", "")).message().find("the header is not"),
            std::string::npos);
  const std::pair<const char*, const char*> cases[] = {
      {R"({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})", "unknown dtype 'Q4'"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})",
       "is F32 [2]: 8 bytes, but its data offsets span 4"},
      {R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 4]}})", "not a size"},
      {R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}})", "after its end"},
      {R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
       "tensors 'a' and 'b' overlap"},
      {R"({"a": {"dtype": "U8", "shape": [4]}})", "needs \"dtype\", \"shape\" and two"},
      {R"([1, 2])", "the header is not a JSON object"},
      {R"({"a": )", "the header is not a JSON object"},
  };
  for (const auto& [header, want] : cases) {
    const Status s = error(Write("bad.safetensors", header, std::string(16, '\0')));
    EXPECT_EQ(s.code(), Code::kCorruption) << header;
    EXPECT_NE(s.message().find(want), std::string::npos) << header << ": " << s.ToString();
  }
  std::string huge = U64(uint64_t{1} << 62);
  const std::string hpath = testing::TempDir() + "/huge.safetensors";
  std::ofstream(hpath, std::ios::binary) << huge;
  EXPECT_NE(error(hpath).message().find("the header claims"), std::string::npos);
  EXPECT_EQ(error(testing::TempDir() + "/absent.safetensors").code(), Code::kIoError);
  EXPECT_EQ(LayoutDtype("F8_E4M3"), "fp8_e4m3");
  EXPECT_EQ(LayoutDtype("nope"), "");
}

// Issue 33, item 3: the reader reads the file it checked. A checkpoint rewritten in place,
// cut short or replaced under its name after Open is named; no row of another file is read.
TEST(SafetensorsTest, AFileChangedOrReplacedAfterOpenIsNamedAndNoRowIsRead) {
  const std::string data = Data();
  const std::string w13_other = std::string(48, '\x55');  // another file's rows
  auto rewritten = [&](const std::string& name,
                       const std::function<void(const std::string&)>& change,
                       const std::string& want) {
    const std::string path = Write(name, kHeader, data);
    Result<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    uint8_t row[12];
    ASSERT_TRUE(f->ReadExpertRow("layers.0.w13", 1, W13(), row).ok());
    change(path);
    uint8_t after[12];
    std::memset(after, 0xee, sizeof(after));
    const Status s = f->ReadExpertRow("layers.0.w13", 1, W13(), after);
    EXPECT_EQ(s.code(), Code::kCorruption) << name << ": " << s.ToString();
    EXPECT_NE(s.message().find("changed since it was opened (" + want), std::string::npos)
        << name << ": " << s.ToString();
    for (uint8_t b : after) EXPECT_EQ(b, 0xee) << name << ": a row was written";
  };
  // Another model's file of the same size, renamed over it (what a model update does).
  rewritten(
      "renamed.safetensors",
      [&](const std::string& path) {
        const std::string other = Write("other.safetensors", kHeader, w13_other + data.substr(48));
        ASSERT_EQ(std::rename(other.c_str(), path.c_str()), 0);
      },
      "the name now names another file");
  // Rewritten in place, same size.
  rewritten(
      "inplace.safetensors",
      [&](const std::string& path) {
        struct timespec later[2] = {{0, UTIME_OMIT},
                                    {4102444800, 0}};  // a modification time of 2100
        std::ofstream(path, std::ios::binary | std::ios::in | std::ios::out)
            << U64(std::string(kHeader).size()) << kHeader << w13_other;
        ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), later, 0), 0);
      },
      "it was modified");
  rewritten(
      "shrunk.safetensors",
      [&](const std::string& path) { ASSERT_EQ(truncate(path.c_str(), 20), 0); },
      "its size went from");
  rewritten(
      "removed.safetensors", [&](const std::string& path) { ASSERT_EQ(unlink(path.c_str()), 0); },
      "its name is gone");
}

// Issue 33, item 5: a header nested 200,000 deep is refused by name (it crashed the reader),
// and so is a NUL with garbage after the JSON (it was accepted); trailing spaces, which the
// format allows as padding, are not.
TEST(SafetensorsTest, DeepNestingAndANulInTheHeaderAreRefused) {
  auto error = [](const std::string& path) { return SafetensorsFile::Open(path).status(); };
  const std::string deep = R"({"a": {"dtype": "U8", "shape": )" + std::string(200000, '[') +
                           std::string(200000, ']') + R"(, "data_offsets": [0, 0]}})";
  const Status d = error(Write("deep.safetensors", deep, ""));
  EXPECT_EQ(d.code(), Code::kCorruption) << d.ToString();
  // The 9th bracket: two objects, then the seventh '[' of the shape.
  const size_t ninth = std::string(R"({"a": {"dtype": "U8", "shape": )").size() + 6;
  EXPECT_NE(d.message().find("header: JSON nested more than 8 deep at byte " +
                             std::to_string(ninth) + " (the limit"),
            std::string::npos)
      << d.ToString();
  const std::string nul = std::string(kHeader) + std::string(1, '\0') + "garbage{";
  const Status n = error(Write("nul.safetensors", nul, Data()));
  EXPECT_EQ(n.code(), Code::kCorruption) << n.ToString();
  EXPECT_NE(n.message().find("header: not valid JSON (a NUL byte at byte " +
                             std::to_string(std::string(kHeader).size()) + ")"),
            std::string::npos)
      << n.ToString();
  // Brackets inside strings do not count, escapes are skipped.
  const std::string quoted =
      R"({"__metadata__": {"note": "[[[[[[[[[[{{{{{{{{{{ \" [[[[["}, "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})";
  EXPECT_TRUE(SafetensorsFile::Open(Write("quoted.safetensors", quoted, "abcd")).ok())
      << error(Write("quoted.safetensors", quoted, "abcd")).ToString();
  const std::string padded = std::string(kHeader) + "        ";
  EXPECT_TRUE(SafetensorsFile::Open(Write("padded.safetensors", padded, Data())).ok());
}

}  // namespace
}  // namespace eplbx::io
