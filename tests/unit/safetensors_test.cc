// The checkpoint as a backup source (issue 20, item 3c): expert rows read from a safetensors
// file, checked against the layout; truncated or mismatched files are clear errors.
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
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

}  // namespace
}  // namespace eplbx::io
