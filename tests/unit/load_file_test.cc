#include "io/load_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/npy.h"

namespace eplbx::io {
namespace {

std::string Message(const Status& s) { return s.message(); }

void ExpectError(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s.ok()) << "expected an error containing: " << needle;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
}

TEST(LoadJsonTest, ArrayAndObjectForms) {
  Result<LoadMatrix> a = ParseLoadJson("[[1, 2.5], [3, 4]]", "x.json");
  ASSERT_TRUE(a.ok()) << Message(a.status());
  EXPECT_EQ(a->layers(), 2);
  EXPECT_EQ(a->experts(), 2);
  EXPECT_DOUBLE_EQ(a->at(0, 1), 2.5);
  Result<LoadMatrix> b = ParseLoadJson(R"({"load": [[1, 2, 3]], "note": "x"})", "x.json");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->experts(), 3);
}

TEST(LoadJsonTest, Errors) {
  ExpectError(ParseLoadJson("[[1, 2]", "x.json").status(), "x.json: not valid JSON (byte");
  ExpectError(ParseLoadJson("{\"weights\": []}", "x.json").status(),
              "x.json: JSON object has no key \"load\"");
  ExpectError(ParseLoadJson("[[1, \"a\"]]", "x.json").status(),
              "x.json: layer 0, expert 1: string \"a\" is not a number");
  ExpectError(ParseLoadJson("[[1, 2], 3]", "x.json").status(), "x.json: layer 1 is a number");
  ExpectError(ParseLoadJson("[[1, 2], [3]]", "x.json").status(),
              "x.json: layer 1 has 1 experts but layer 0 has 2");
  ExpectError(ParseLoadJson("[[1, -2]]", "x.json").status(),
              "x.json: layer 0, expert 1: load is -2");
  ExpectError(ParseLoadJson("[]", "x.json").status(), "x.json: load is empty");
  ExpectError(ParseLoadJson("7", "x.json").status(), "top level is a number");
  ExpectError(ParseLoadJson("{\"load\": 3}", "x.json").status(), "\"load\" is a number");
}

TEST(LoadCsvTest, ParsesLayersPerLine) {
  Result<LoadMatrix> m = ParseLoadCsv("# comment\n1, 2,3\r\n\n4,5,6.5\n", "x.csv");
  ASSERT_TRUE(m.ok()) << Message(m.status());
  EXPECT_EQ(m->layers(), 2);
  EXPECT_DOUBLE_EQ(m->at(1, 2), 6.5);
}

TEST(LoadCsvTest, Errors) {
  ExpectError(ParseLoadCsv("1,2\n3,x\n", "x.csv").status(),
              "x.csv: line 2, column 2: 'x' is not a number");
  ExpectError(ParseLoadCsv("1,,2\n", "x.csv").status(), "line 1, column 2: '' is not a number");
  ExpectError(ParseLoadCsv("1,2\n3\n", "x.csv").status(), "layer 1 has 1 experts");
  ExpectError(ParseLoadCsv("\n# only\n", "x.csv").status(), "x.csv: no data");
  ExpectError(ParseLoadCsv("1,nan\n", "x.csv").status(), "load is nan");
}

// Hand-built .npy bytes for any dtype.
std::string RawNpy(std::string header, const std::string& data, int major = 1);

std::string Npy(const std::string& descr, const std::string& shape, const std::string& data,
                bool fortran = false, int major = 1) {
  return RawNpy("{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                    ", 'shape': " + shape + ", }",
                data, major);
}

std::string RawNpy(std::string header, const std::string& data, int major) {
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  if (major == 1) {
    out += static_cast<char>(header.size() & 0xff);
    out += static_cast<char>(header.size() >> 8);
  } else {
    for (int k = 0; k < 4; ++k) out += static_cast<char>((header.size() >> (8 * k)) & 0xff);
  }
  return out + header + data;
}

template <typename T>
std::string Bytes(std::initializer_list<T> values, bool big = false) {
  std::string out;
  for (T v : values) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    if (big) std::reverse(b, b + sizeof(T));
    out.append(b, sizeof(T));
  }
  return out;
}

TEST(LoadNpyTest, AllSupportedDtypes) {
  struct Case {
    std::string descr, data;
  };
  const std::vector<Case> cases = {
      {"<f4", Bytes<float>({1, 2, 3, 4, 5, 6})},
      {"<f8", Bytes<double>({1, 2, 3, 4, 5, 6})},
      {"<i4", Bytes<int32_t>({1, 2, 3, 4, 5, 6})},
      {"<i8", Bytes<int64_t>({1, 2, 3, 4, 5, 6})},
      {">f8", Bytes<double>({1, 2, 3, 4, 5, 6}, true)},
      {">i4", Bytes<int32_t>({1, 2, 3, 4, 5, 6}, true)},
  };
  for (const Case& c : cases) {
    Result<LoadMatrix> m = ParseLoadNpy(Npy(c.descr, "(2, 3)", c.data), "x.npy");
    ASSERT_TRUE(m.ok()) << c.descr << ": " << Message(m.status());
    EXPECT_EQ(m->layers(), 2);
    EXPECT_EQ(m->experts(), 3);
    EXPECT_DOUBLE_EQ(m->at(1, 2), 6) << c.descr;
    EXPECT_DOUBLE_EQ(m->at(0, 1), 2) << c.descr;
  }
  Result<LoadMatrix> v2 =
      ParseLoadNpy(Npy("<f8", "(1, 2)", Bytes<double>({7, 8}), false, 2), "x.npy");
  ASSERT_TRUE(v2.ok()) << Message(v2.status());
  EXPECT_DOUBLE_EQ(v2->at(0, 1), 8);
}

TEST(LoadNpyTest, RoundTripsOurEncoder) {
  const std::string bytes = EncodeNpyF64(2, 2, {1, 2, 3, 4.5});
  Result<LoadMatrix> m = ParseLoadNpy(bytes, "x.npy");
  ASSERT_TRUE(m.ok()) << Message(m.status());
  EXPECT_DOUBLE_EQ(m->at(1, 1), 4.5);
}

TEST(LoadNpyTest, Errors) {
  const std::string d = Bytes<double>({1, 2, 3, 4, 5, 6});
  ExpectError(ParseLoadNpy("hello world", "x.npy").status(), "x.npy: not a .npy file");
  ExpectError(ParseLoadNpy(Npy("<f8", "(2, 3)", d, false, 9), "x.npy").status(),
              ".npy version 9.0 is not supported");
  ExpectError(ParseLoadNpy(Npy("<f8", "(2, 3)", d, true), "x.npy").status(), "Fortran order");
  ExpectError(ParseLoadNpy(Npy("<f2", "(2, 3)", d), "x.npy").status(),
              "dtype '<f2' is not supported");
  ExpectError(ParseLoadNpy(Npy("<u8", "(2, 3)", d), "x.npy").status(),
              "dtype '<u8' is not supported");
  ExpectError(ParseLoadNpy(Npy("<f8", "(6,)", d), "x.npy").status(),
              "array has shape (6,) (expected 2-D");
  ExpectError(ParseLoadNpy(Npy("<f8", "(2, 4)", d), "x.npy").status(), "(truncated file)");
  ExpectError(ParseLoadNpy(Npy("<f8", "(2, 2)", d), "x.npy").status(), "(trailing bytes)");
  ExpectError(ParseLoadNpy(Npy("<f8", "(2, x)", d), "x.npy").status(),
              "header has a 'shape' that is not a tuple of integers");
  // Issue 17, item 16: the header was searched by substring, so garbage and non-dict
  // headers were accepted and a duplicate key was read unlike numpy.
  const std::string ok = "'descr': '<f8', 'fortran_order': False, 'shape': (2, 3)";
  ExpectError(ParseLoadNpy(RawNpy("garbage " + ok, d), "x.npy").status(), "header is not a dict");
  ExpectError(ParseLoadNpy(RawNpy("[" + ok + "]", d), "x.npy").status(), "header is not a dict");
  ExpectError(ParseLoadNpy(RawNpy("{" + ok + ", 'shape': (3, 2)}", d), "x.npy").status(),
              "header has 'shape' twice");
  ExpectError(ParseLoadNpy(RawNpy("{'descr': '<f8', 'shape': (2, 3)}", d), "x.npy").status(),
              "header has no 'fortran_order' entry");
  ExpectError(ParseLoadNpy(RawNpy("{" + ok + ", 'extra': 1}", d), "x.npy").status(),
              "header has an unknown key 'extra'");
  ExpectError(ParseLoadNpy(RawNpy("{" + ok + "} junk", d), "x.npy").status(),
              "header has text after the dict");
  EXPECT_TRUE(ParseLoadNpy(RawNpy("{" + ok + ",}", d), "x.npy").ok());
  const Status missing =
      ParseLoadNpy(RawNpy("{'descr': '<f8', 'fortran_order': False}", d), "x.npy").status();
  EXPECT_EQ(missing.message().find('\n'), std::string::npos) << missing.message();
  std::string truncated = Npy("<f8", "(2, 3)", d).substr(0, 20);
  ExpectError(ParseLoadNpy(truncated, "x.npy").status(), "truncated .npy header");
  ExpectError(
      ParseLoadNpy(Npy("<f8", "(1, 6)", Bytes<double>({1, 2, 3, -4, 5, 6})), "x.npy").status(),
      "layer 0, expert 3: load is -4");
}

TEST(LoadFileTest, PicksParserByExtension) {
  const auto dir = std::filesystem::temp_directory_path() / "eplbx_load_file_test";
  std::filesystem::create_directories(dir);
  const std::string json = (dir / "a.json").string(), csv = (dir / "a.csv").string(),
                    npy = (dir / "a.npy").string(), txt = (dir / "a.txt").string();
  std::ofstream(json) << "[[1,2],[3,4]]";
  std::ofstream(csv) << "1,2\n3,4\n";
  std::ofstream(npy, std::ios::binary) << EncodeNpyF64(2, 2, {1, 2, 3, 4});
  std::ofstream(txt) << "1,2";
  for (const std::string& path : {json, csv, npy}) {
    Result<LoadMatrix> m = ReadLoadFile(path);
    ASSERT_TRUE(m.ok()) << Message(m.status());
    EXPECT_DOUBLE_EQ(m->at(1, 0), 3) << path;
  }
  ExpectError(ReadLoadFile(txt).status(), "unknown extension '.txt'");
  ExpectError(ReadLoadFile((dir / "missing.json").string()).status(), "missing.json: no such file");
  EXPECT_EQ(ReadLoadFile((dir / "missing.json").string()).status().code(), Code::kNotFound);
  std::filesystem::remove_all(dir);
}

TEST(PlacementJsonTest, ReadsPhy2Log) {
  Result<Placement> p = ParsePlacementJson(R"({"phy2log": [[0, 1, -1, 1]]})", "p.json");
  ASSERT_TRUE(p.ok()) << Message(p.status());
  EXPECT_EQ(p->experts(), 2);
  EXPECT_EQ(p->logcnt(0, 1), 2);
  Result<Placement> wide =
      ParsePlacementJson(R"({"phy2log": [[0, 1]], "logcnt": [[1, 1, 0]]})", "p.json");
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->experts(), 3);
  ExpectError(ParsePlacementJson("[[0]]", "p.json").status(), "top level is a array");
  ExpectError(ParsePlacementJson(R"({"phy2log": [[0, 1.5]]})", "p.json").status(),
              "phy2log layer 0, slot 1: 1.5 is not an expert id");
  ExpectError(ParsePlacementJson(R"({"phy2log": [[0, 1], [0]]})", "p.json").status(),
              "phy2log layer 1 has 1 slots but layer 0 has 2");
  ExpectError(ParsePlacementJson(R"({"phy2log": [[0, -3]]})", "p.json").status(),
              "slot 1: -3 is not an expert id");
}

}  // namespace
}  // namespace eplbx::io
