#include "transport/channel_secret.h"

#include <utility>
#include <vector>

namespace paramd {

ChannelSecret::ChannelSecret()
    : authenticator_(std::make_shared<auth::Authenticator>(std::vector<auth::TokenEntry>())),
      token_(std::make_shared<auth::BearerToken>()),
      security_(std::make_shared<const auth::ChannelSecurity>(
          auth::ChannelSecurity{auth::TlsConfig(), token_})) {}

ChannelSecret::ChannelSecret(const std::string& secret) : ChannelSecret() { Set(secret); }

void ChannelSecret::Set(const std::string& secret) {
  if (secret.empty()) return;
  // Accepted before presented: a peer never sees this side present a
  // secret it would itself still refuse.
  authenticator_->AddClusterSecret(secret);
  token_->Set(secret);
}

TransportOptions ChannelSecret::Apply(TransportOptions base) const {
  base.authenticator = authenticator_;
  base.security = security_;
  return base;
}

}  // namespace paramd
