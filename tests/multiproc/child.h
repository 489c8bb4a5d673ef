// A child process with line-based stdin/stdout pipes, for multi-process tests.
#ifndef EPLBX_TESTS_MULTIPROC_CHILD_H_
#define EPLBX_TESTS_MULTIPROC_CHILD_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace eplbx::testing {

class Child {
 public:
  // Starts `argv[0]` with `argv`; `env` entries are added to the environment.
  Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {}) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~Child() {
    if (to_ >= 0) close(to_);
    if (from_ >= 0) close(from_);
    if (pid_ > 0) {
      kill(pid_, SIGCONT);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  bool Send(const std::string& line) {
    std::string l = line + "\n";
    return write(to_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }
  // The next line, or "" after `timeout` or at end of output.
  std::string ReadLine(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      ssize_t n = read(from_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }
  // Reads lines until one starts with `prefix`; returns the rest of it ("" on timeout).
  std::string Expect(const std::string& prefix,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    while (true) {
      std::string line = ReadLine(timeout);
      if (line.empty()) return "";
      if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    }
  }
  void Signal(int sig) { kill(pid_, sig); }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string buffer_;
};

}  // namespace eplbx::testing

#endif  // EPLBX_TESTS_MULTIPROC_CHILD_H_
