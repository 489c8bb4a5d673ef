// The UCX backend's peers: heartbeats and failure (a peer silent for the timeout, or whose
// endpoint UCX reports broken, fails with its transfers), and active messages
// (notifications, pings and pongs).
#include "transfer/ucx/ucx_worker.h"

namespace eplbx::internal::ucx {

Status UcxWorker::Unreachable(const PeerState& p) const {
  if (p.disconnected) {
    return Status::Aborted(
        StrCat("agent '", options_.agent_name, "': peer '", p.name, "' ", p.failure));
  }
  return Status::Unavailable(StrCat("agent '", options_.agent_name, "': peer unreachable: '",
                                    p.name, "' (", p.failure, ")"));
}

void UcxWorker::MarkFailed(PeerState& p, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.failed) return;
    p.failure = why;
    p.failed = true;
  }
  if (!p.disconnected) listener_->OnPeerFailed(p.id, Unreachable(p));
}

void UcxWorker::FailPeer(const std::shared_ptr<PeerState>& p, const std::string& why) {
  MarkFailed(*p, why);
  CloseEp(p);
}

void UcxWorker::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<PeerState*>(arg);
  UcxWorker* self = p->self;
  self->MarkFailed(*p, StrCat("connection lost: ", Ucs(status)));
  // UCX forbids closing the endpoint inside this callback; the loop closes it next.
  std::lock_guard<std::mutex> lock(self->mu_);
  auto it = self->peers_.find(p->id);
  if (it != self->peers_.end() && it->second.get() == p) {
    self->commands_.push_back([self, sp = it->second] { self->CloseEp(sp); });
  }
}

void UcxWorker::CloseEp(const std::shared_ptr<PeerState>& p) {
  if (p->ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void* req = ucp_ep_close_nbx(p->ep, &param);
  p->ep = nullptr;
  if (UCS_PTR_IS_PTR(req)) {
    closing_.push_back({req, p});
  } else {
    DestroyRkeys(*p);
  }
}

void UcxWorker::FinishCloses() {
  for (size_t i = 0; i < closing_.size();) {
    if (ucp_request_check_status(closing_[i].first) == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    ucp_request_free(closing_[i].first);
    DestroyRkeys(*closing_[i].second);
    closing_.erase(closing_.begin() + static_cast<long>(i));
  }
}

void UcxWorker::DestroyRkeys(PeerState& p) {
  for (ucp_rkey_h k : p.rkeys) {
    if (k != nullptr) ucp_rkey_destroy(k);
  }
  p.rkeys.clear();
}

void UcxWorker::Heartbeat(Clock::time_point now) {
  std::vector<std::shared_ptr<PeerState>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : peers_) all.push_back(p);
  }
  for (auto& p : all) {
    if (p->failed) continue;
    if (now - p->last_heard > options_.peer_timeout) {
      FailPeer(p, StrCat("no answer for ", options_.peer_timeout.count(),
                         " ms: process stopped, hung or unreachable over the network"));
    } else if (now - p->last_ping >= ping_interval_) {
      p->last_ping = now;
      SendAm(*p, MessageKind::kPing, {}, nullptr);
    }
  }
}

void UcxWorker::SendAm(PeerState& p, MessageKind kind, std::string payload,
                       std::function<void(Status)> sent) {
  if (p.ep == nullptr) {
    if (sent) sent(Unreachable(p));
    return;
  }
  auto* msg = new AmMessage{this, EncodeMessageHeader({kind, options_.agent_name}), p.name,
                            std::move(sent)};
  msg->bytes += payload;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxWorker::OnAmSent;
  param.user_data = msg;
  param.flags = UCP_AM_SEND_FLAG_EAGER | (kind == MessageKind::kPing ? UCP_AM_SEND_FLAG_REPLY : 0);
  SendAmOn(p.ep, msg, &param);
}

void UcxWorker::SendAmOn(ucp_ep_h ep, AmMessage* msg, const ucp_request_param_t* param) {
  void* req = ucp_am_send_nbx(ep, kAmId, nullptr, 0, msg->bytes.data(), msg->bytes.size(), param);
  if (req == nullptr) {
    if (msg->sent) msg->sent(Status::OK());
    delete msg;
  } else if (UCS_PTR_IS_ERR(req)) {
    if (msg->sent) {
      msg->sent(Status::Unavailable(StrCat("agent '", options_.agent_name, "': notification to '",
                                           msg->peer, "' failed: ", Ucs(UCS_PTR_STATUS(req)))));
    }
    delete msg;
  } else {
    ++inflight_;
  }
}

void UcxWorker::OnAmSent(void* request, ucs_status_t status, void* user_data) {
  auto* msg = static_cast<AmMessage*>(user_data);
  UcxWorker* self = msg->self;
  --self->inflight_;
  if (msg->sent) {
    std::shared_ptr<PeerState> p;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (auto it = self->by_name_.find(msg->peer); it != self->by_name_.end()) p = it->second;
    }
    if (status == UCS_OK) {
      msg->sent(Status::OK());
    } else if (p != nullptr && p->failed) {
      msg->sent(self->Unreachable(*p));
    } else {
      msg->sent(
          Status::Unavailable(StrCat("agent '", self->options_.agent_name, "': notification to '",
                                     msg->peer, "' failed: ", Ucs(status))));
    }
  }
  delete msg;
  ucp_request_free(request);
}

ucs_status_t UcxWorker::OnAm(void* arg, const void*, size_t, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxWorker*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent
  std::string_view bytes(static_cast<const char*>(data), length);
  size_t consumed = 0;
  Result<MessageHeader> h = DecodeMessageHeader(bytes, &consumed);
  if (!h.ok()) {
    ++self->dropped_messages_;
    return UCS_OK;
  }
  if (auto it = self->by_name_.find(h->sender); it != self->by_name_.end()) {
    it->second->last_heard = Clock::now();
  }
  switch (h->kind) {
    case MessageKind::kNotify:
      self->listener_->OnNotification(std::move(h->sender), std::string(bytes.substr(consumed)));
      break;
    case MessageKind::kPing:
      if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 && param->reply_ep != nullptr) {
        auto* msg = new AmMessage{
            self, EncodeMessageHeader({MessageKind::kPong, self->options_.agent_name}), h->sender,
            nullptr};
        ucp_request_param_t p{};
        p.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        p.cb.send = &UcxWorker::OnAmSent;
        p.user_data = msg;
        p.flags = UCP_AM_SEND_FLAG_EAGER;
        self->SendAmOn(param->reply_ep, msg, &p);
      }
      break;
    case MessageKind::kPong:
      break;
  }
  return UCS_OK;
}

}  // namespace eplbx::internal::ucx
