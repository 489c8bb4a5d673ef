// The UCX backend's peers: heartbeats and failure (a peer silent for the timeout, or whose
// endpoint UCX reports broken, fails with its transfers), and active messages
// (notifications, pings and pongs).
#include <cstring>

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
  // What the peer put in the inbox before it was lost (its last DONE, say) is delivered
  // before the loss, as UCX delivers a message before the error of its connection.
  if (!p.failed && !p.disconnected) DrainLocal();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.failed) return;
    p.failure = why;
    p.failed = true;
  }
  if (p.disconnected) return;
  listener_->OnPeerFailed(p.id, Unreachable(p));
  if (stage_sink_ != nullptr) stage_sink_->OnStagePeerFailed(p.id, Unreachable(p));
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
  CloseLocal(*p, "");
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
  // Notifications to a peer of this host go through its inbox; liveness stays on UCX.
  if (kind != MessageKind::kPing && SendLocal(p, msg)) return;
  SendAmOn(p.ep, msg,
           UCP_AM_SEND_FLAG_EAGER | (kind == MessageKind::kPing ? UCP_AM_SEND_FLAG_REPLY : 0));
}

void UcxWorker::SendAmOn(ucp_ep_h ep, AmMessage* msg, uint32_t flags) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxWorker::OnAmSent;
  param.user_data = msg;
  param.flags = flags;
  void* req = msg->stage ? ucp_am_send_nbx(ep, kAmId, msg->bytes.data(), msg->bytes.size(),
                                           msg->data, msg->data_bytes, &param)
                         : ucp_am_send_nbx(ep, kAmId, nullptr, 0, msg->bytes.data(),
                                           msg->bytes.size(), &param);
  if (req == nullptr) {
    if (msg->sent) msg->sent(Status::OK());
    delete msg;
  } else if (UCS_PTR_IS_ERR(req)) {
    if (msg->sent) {
      msg->sent(Status::Unavailable(StrCat("agent '", options_.agent_name, "': message to '",
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

ucs_status_t UcxWorker::OnAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxWorker*>(arg);
  if (header_length > 0) {
    return self->OnStageAm({static_cast<const char*>(header), header_length}, data, length, param);
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;  // never sent
  const bool reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
  self->Deliver({static_cast<const char*>(data), length}, reply ? param->reply_ep : nullptr);
  return UCS_OK;
}

void UcxWorker::Deliver(std::string_view bytes, ucp_ep_h reply_ep) {
  size_t consumed = 0;
  Result<MessageHeader> h = DecodeMessageHeader(bytes, &consumed);
  if (!h.ok()) {
    ++dropped_messages_;
    return;
  }
  if (auto it = by_name_.find(h->sender); it != by_name_.end()) {
    it->second->last_heard = Clock::now();
  }
  switch (h->kind) {
    case MessageKind::kNotify:
      listener_->OnNotification(std::move(h->sender), std::string(bytes.substr(consumed)));
      break;
    case MessageKind::kNotifyBatch: {
      Result<std::vector<std::string>> batch = DecodeNotifyBatch(bytes.substr(consumed));
      if (batch.ok()) {
        listener_->OnNotifications(std::move(h->sender), std::move(*batch));
      } else {
        // Delivered as it came: the receiver's decoder names the sender and what is wrong,
        // instead of a layer waiting for its deadline.
        listener_->OnNotification(std::move(h->sender), std::string(bytes.substr(consumed)));
      }
      break;
    }
    case MessageKind::kPing:
      if (reply_ep != nullptr) {
        auto* msg =
            new AmMessage{this, EncodeMessageHeader({MessageKind::kPong, options_.agent_name}),
                          h->sender, nullptr};
        SendAmOn(reply_ep, msg, UCP_AM_SEND_FLAG_EAGER);
      }
      break;
    case MessageKind::kPong:
    case MessageKind::kStage:  // comes with a header (OnStageAm)
      break;
  }
}

void UcxWorker::SetStageSink(std::shared_ptr<StageSink> sink) {
  (void)RunSync<bool>([&]() -> Result<bool> {
    stage_sink_ = std::move(sink);
    return true;
  });
}

Status UcxWorker::SendStage(PeerId peer, std::string head, const void* data, size_t bytes,
                            std::function<void(Status)> sent) {
  Result<std::shared_ptr<PeerState>> p = LivePeer(peer);
  if (!p.ok()) return p.status();
  Enqueue([this, p = std::move(*p), head = std::move(head), data, bytes,
           sent = std::move(sent)]() mutable {
    if (p->failed || p->ep == nullptr) {
      if (sent) sent(Unreachable(*p));
      return;
    }
    // The head goes in the message's header (it marks the message as the path's); the data
    // as its payload, by rendezvous when large (UCX reads it from `data`).
    auto* msg = new AmMessage{
        this,    EncodeMessageHeader({MessageKind::kStage, options_.agent_name}) + head,
        p->name, std::move(sent),
        true,    data,
        bytes};
    SendAmOn(p->ep, msg, UCP_AM_SEND_FLAG_REPLY);  // a receiver not connected to us can answer
  });
  return Status::OK();
}

ucs_status_t UcxWorker::OnStageAm(std::string_view header, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  size_t consumed = 0;
  Result<MessageHeader> h = DecodeMessageHeader(header, &consumed);
  if (!h.ok() || h->kind != MessageKind::kStage || stage_sink_ == nullptr) {
    ++dropped_messages_;
    return rndv ? UCS_ERR_REJECTED : UCS_OK;  // the sender's send fails: nobody reads it
  }
  auto it = by_name_.find(h->sender);
  if (it == by_name_.end()) {
    // Not connected to the sender: tell it so on the message's own endpoint, now (as a PONG
    // is sent), so that its transfer fails by name instead of waiting.
    std::string answer = stage_sink_->OnStageFromStranger(h->sender, header.substr(consumed));
    if (!answer.empty() && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 &&
        param->reply_ep != nullptr) {
      auto* msg = new AmMessage{
          this, EncodeMessageHeader({MessageKind::kStage, options_.agent_name}) + answer, h->sender,
          nullptr, true};
      SendAmOn(param->reply_ep, msg, 0);
    }
    ++dropped_messages_;
    return rndv ? UCS_ERR_REJECTED : UCS_OK;
  }
  PeerState& p = *it->second;
  p.last_heard = Clock::now();
  const std::string_view head = header.substr(consumed);
  void* dest = stage_sink_->OnStage(p.id, head, length);
  if (length == 0) return UCS_OK;
  if (dest == nullptr) return rndv ? UCS_ERR_REJECTED : UCS_OK;
  if (!rndv) {
    std::memcpy(dest, data, length);
    stage_sink_->OnStageLanded(p.id, std::string(head), Status::OK());
    return UCS_OK;
  }
  auto* r = new StageReceive{this, stage_sink_, p.id, std::string(head)};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = &UcxWorker::OnStageReceived;
  rp.user_data = r;
  void* req = ucp_am_recv_data_nbx(worker_, data, dest, length, &rp);
  if (req == nullptr) {
    stage_sink_->OnStageLanded(p.id, r->head, Status::OK());
    delete r;
  } else if (UCS_PTR_IS_ERR(req)) {
    stage_sink_->OnStageLanded(
        p.id, r->head,
        Status::Unavailable(StrCat("agent '", options_.agent_name, "': receiving from '", p.name,
                                   "' failed: ", Ucs(UCS_PTR_STATUS(req)))));
    delete r;
  } else {
    ++inflight_;
  }
  return UCS_OK;
}

void UcxWorker::OnStageReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  auto* r = static_cast<StageReceive*>(user_data);
  UcxWorker* self = r->self;
  --self->inflight_;
  r->sink->OnStageLanded(r->peer, r->head,
                         status == UCS_OK ? Status::OK()
                                          : Status::Unavailable(StrCat(
                                                "agent '", self->options_.agent_name,
                                                "': receiving staged rows failed: ", Ucs(status))));
  delete r;
  ucp_request_free(request);
}

}  // namespace eplbx::internal::ucx
