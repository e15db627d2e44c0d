// File: transport/channel_secret.h
//
// The one-time secret of a device channel's world (docs/SECURITY.md,
// "Device channels"): a 2-rank transport world between one daemon and one
// trainer, whose members hold no cluster secret (a trainer holds a token of
// role `trainer`, which the daemons do not present). The daemon draws a
// fresh secret per channel (auth::RandomSecret) and hands it to the trainer
// in the first event of the authenticated Daemon.OpenDeviceChannel call;
// both endpoints of the world are opened with Apply(), so that
//
//  * their DataPlane service (the host endpoints an NCCL endpoint runs for
//    headers, clear-to-sends and NCCL unique ids) accepts only callers
//    presenting the secret as bearer token, and presents it itself;
//  * the NCCL endpoint's socket control channel (transport/socket_channel.h)
//    accepts only connections proving it (nonce + HMAC-SHA256), and proves
//    it on its own.
//
// A process that knows the endpoints' addresses but not the secret can
// therefore neither inject a header, a clear-to-send or a unique id nor
// disturb the channel. The trainer opens its endpoint before it knows the
// secret (its address goes into the OpenDeviceChannel request): until Set()
// its endpoint refuses everyone (a peer's UNAUTHENTICATED is retried until
// the call's deadline, transport/transport.h) and its control channel takes
// no connection before Connect, which the trainer calls after Set().
//
// The bootstrap traffic itself is not encrypted (the trainer has no server
// certificate to serve TLS with): the bearer token of a DataPlane call can
// be read by whoever can read the traffic, who could also read the NCCL
// data. It is worth nothing once the channel is closed.
//
// Threading: thread-safe; Set may race with the endpoints' use of the
// options.
#ifndef PARAMD_TRANSPORT_CHANNEL_SECRET_H_
#define PARAMD_TRANSPORT_CHANNEL_SECRET_H_

#include <memory>
#include <string>

#include "auth/security.h"
#include "transport/transport.h"

namespace paramd {

class ChannelSecret {
 public:
  // Not yet known (the trainer's side): Set() it once the daemon sent it.
  ChannelSecret();
  // Known from the start (the daemon's side). Empty = not yet known.
  explicit ChannelSecret(const std::string& secret);

  // Accepts and presents `secret` from now on (a second call adds a second
  // accepted secret: call once). Empty is ignored.
  void Set(const std::string& secret);

  // `base` with the endpoint's authenticator and channel security replaced
  // by this secret's: pass the result to OpenNcclEndpoint (or any host
  // endpoint) of the world. Plaintext: `base.security`'s TLS is dropped.
  TransportOptions Apply(TransportOptions base) const;

 private:
  std::shared_ptr<auth::Authenticator> authenticator_;
  std::shared_ptr<auth::BearerToken> token_;
  std::shared_ptr<const auth::ChannelSecurity> security_;
};

}  // namespace paramd

#endif  // PARAMD_TRANSPORT_CHANNEL_SECRET_H_
