// A real etcd cluster for tests: `members` etcd processes (Debian's etcd-server) on free
// loopback ports, each in its own temporary directory, started in the constructor and
// killed (with their directories removed) in the destructor. Without an etcd binary the
// tests skip, saying so.
#ifndef EPLBX_TESTS_UNIT_ETCD_CLUSTER_H_
#define EPLBX_TESTS_UNIT_ETCD_CLUSTER_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "coord/etcd_client.h"
#include "free_port.h"

namespace eplbx::testing {

inline std::string EtcdBinary() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

class EtcdCluster {
 public:
  explicit EtcdCluster(int members) {
    binary_ = EtcdBinary();
    if (binary_.empty()) return;
    char tmpl[] = "/tmp/eplbx-etcd-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    // A port Port() named may be taken (by another test) before etcd binds it: a member
    // that exits is started again, all of them on new ports.
    for (int attempt = 0; attempt < 3 && !ready_; ++attempt) {
      if (attempt > 0) {
        StopAll();
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
        std::filesystem::create_directory(dir_, ec);
      }
      Start(members);
    }
  }
  ~EtcdCluster() {
    StopAll();
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  bool ready() const { return ready_; }
  std::string why_not() const {
    return binary_.empty() ? "no etcd binary (apt-get install etcd-server; scripts/setup.sh does)"
                           : "the etcd cluster did not start (see " + dir_ + ")";
  }
  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (int p : client_ports_) out.push_back("127.0.0.1:" + std::to_string(p));
    return out;
  }
  // SIGKILL member i (its data stays: Restart brings it back).
  void Kill(int i) {
    if (i >= 0 && i < static_cast<int>(pids_.size()) && pids_[i] > 0) {
      kill(pids_[i], SIGKILL);
      waitpid(pids_[i], nullptr, 0);
      pids_[i] = -1;
    }
  }
  void Restart(int i) {
    if (i >= 0 && i < static_cast<int>(pids_.size()) && pids_[i] <= 0) {
      pids_[i] = Launch(i, /*existing=*/true);
    }
  }
  // The member that is leader now, or -1.
  int Leader() const {
    for (size_t i = 0; i < client_ports_.size(); ++i) {
      if (pids_[i] <= 0) continue;
      auto c = coord::EtcdClient::Create({endpoints()[i]}, std::chrono::milliseconds(500));
      if (c.ok()) {
        Result<bool> l = (*c)->IsLeader();
        if (l.ok() && *l) return static_cast<int>(i);
      }
    }
    return -1;
  }

 private:
  // Launches `members` on fresh ports; ready_ when a put answers on every member (a leader
  // exists). Returns early when a member exited (its port was taken).
  void Start(int members) {
    client_ports_.clear();
    peer_ports_.clear();
    std::string initial;
    for (int i = 0; i < members; ++i) {
      client_ports_.push_back(Port());
      peer_ports_.push_back(Port());
      if (i > 0) initial += ',';
      initial += Name(i);
      initial += "=http://127.0.0.1:";
      initial += std::to_string(peer_ports_[i]);
    }
    initial_ = initial;
    for (int i = 0; i < members; ++i) pids_.push_back(Launch(i));
    for (int tries = 0; tries < 200 && !ready_; ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      for (pid_t& p : pids_) {
        if (p > 0 && waitpid(p, nullptr, WNOHANG) == p) p = -1;
      }
      if (std::count(pids_.begin(), pids_.end(), -1) > 0) return;
      ready_ = true;
      for (int i = 0; i < members && ready_; ++i) {
        auto c = coord::EtcdClient::Create({endpoints()[i]}, std::chrono::milliseconds(500));
        ready_ = c.ok() && (*c)->Put("ready", "1").ok();
      }
    }
  }
  void StopAll() {
    for (pid_t p : pids_) {
      if (p > 0) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
    }
    pids_.clear();
  }
  static std::string Name(int i) {
    std::string name = std::to_string(i);
    name.insert(name.begin(), 'm');  // (not "m" + ...: GCC 12's -Wrestrict misfires on it)
    return name;
  }
  pid_t Launch(int i, bool existing = false) {
    const std::string client = "http://127.0.0.1:" + std::to_string(client_ports_[i]);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_ports_[i]);
    const std::string data = dir_ + "/" + Name(i);
    const std::string log = dir_ + "/" + Name(i) + ".log";
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // nothing is left behind if the test dies
      // Only async-signal-safe calls between fork and exec (the test has other threads).
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (fd >= 0) dup2(fd, STDERR_FILENO);
      execl(binary_.c_str(), binary_.c_str(), "--name", Name(i).c_str(), "--data-dir", data.c_str(),
            "--listen-client-urls", client.c_str(), "--advertise-client-urls", client.c_str(),
            "--listen-peer-urls", peer.c_str(), "--initial-advertise-peer-urls", peer.c_str(),
            "--initial-cluster", initial_.c_str(), "--initial-cluster-state",
            existing ? "existing" : "new", "--initial-cluster-token", dir_.c_str(),
            "--heartbeat-interval", "50", "--election-timeout", "500", static_cast<char*>(nullptr));
      _exit(127);
    }
    return pid;
  }

  std::string binary_, dir_, initial_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<pid_t> pids_;
  bool ready_ = false;
};

}  // namespace eplbx::testing

#endif  // EPLBX_TESTS_UNIT_ETCD_CLUSTER_H_
