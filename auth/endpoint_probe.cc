#include "auth/endpoint_probe.h"

#include <arpa/inet.h>
#include <errno.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/address.h"
#include "common/status_macros.h"

namespace paramd {
namespace auth {
namespace {

// The client's connection preface (RFC 9113 §3.4) and an empty SETTINGS
// frame; a gRPC server answers with a SETTINGS frame of its own.
constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr char kEmptySettings[9] = {0, 0, 0, 4, 0, 0, 0, 0, 0};
constexpr unsigned char kSettingsType = 4;

struct SocketCloser {
  void operator()(const int* fd) const {
    ::close(*fd);
    delete fd;
  }
};
using Socket = std::unique_ptr<int, SocketCloser>;

// Every read and write on `fd` gives up after `left`.
void SetTimeouts(int fd, absl::Duration left) {
  const timeval tv = absl::ToTimeval(std::max(left, absl::Milliseconds(10)));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// OpenSSL writes to a socket the server may have closed: SIGPIPE is
// blocked on this thread meanwhile and one it raised is taken back.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
  }
  ~SigpipeBlocked() {
    if (!was_pending_) {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe, nullptr, &zero) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t old_;
  bool was_pending_ = false;
};

// Reads an HTTP/2 frame header with `read` (returns bytes read, <= 0 when
// nothing more comes): whether it is the server's SETTINGS frame.
template <class Read>
bool ReadsSettingsFrame(Read read) {
  unsigned char header[9];
  size_t n = 0;
  while (n < sizeof header) {
    const int r = read(header + n, static_cast<int>(sizeof header - n));
    if (r <= 0) break;
    n += static_cast<size_t>(r);
  }
  return n == sizeof header && header[3] == kSettingsType;
}

std::string ClientHello() {
  return absl::StrCat(absl::string_view(kPreface, sizeof kPreface - 1),
                      absl::string_view(kEmptySettings, sizeof kEmptySettings));
}

// Whether the server behind `fd` answers a plaintext HTTP/2 preface.
bool SpeaksPlaintextHttp2(int fd) {
  const std::string hello = ClientHello();
  if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
    return false;
  }
  return ReadsSettingsFrame([fd](unsigned char* p, int n) {
    ssize_t r;
    do {
      r = ::recv(fd, p, static_cast<size_t>(n), 0);
    } while (r < 0 && errno == EINTR);
    return static_cast<int>(r);
  });
}

// What one TLS handshake met.
struct TlsOutcome {
  bool server_spoke_tls = false;       // a TLS handshake or alert record came back
  bool certificate_requested = false;  // the server asked for a client certificate
  bool handshake_done = false;
  bool http2 = false;       // the server's SETTINGS frame read over TLS
  long verify = X509_V_OK;  // the certificate check's result
  int alert = -1;           // the description of an alert the server sent
  std::string error;        // OpenSSL's reasons
};

void OnTlsMessage(int write_p, int /*version*/, int content_type, const void* buf, size_t len,
                  SSL* /*ssl*/, void* arg) {
  if (write_p != 0) return;
  auto* o = static_cast<TlsOutcome*>(arg);
  if (content_type == SSL3_RT_HANDSHAKE) {
    o->server_spoke_tls = true;
    if (len >= 1 && static_cast<const unsigned char*>(buf)[0] == SSL3_MT_CERTIFICATE_REQUEST) {
      o->certificate_requested = true;
    }
  }
  if (content_type == SSL3_RT_ALERT) {
    o->server_spoke_tls = true;
    if (len >= 2) o->alert = static_cast<const unsigned char*>(buf)[1];
  }
}

std::string OpenSslErrors() {
  std::vector<std::string> reasons;
  while (const unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    reasons.push_back(reason != nullptr ? reason : absl::StrCat("error ", e));
  }
  return absl::StrJoin(reasons, "; ");
}

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};

// Loads the client's CA and certificate into `ctx`.
absl::Status UseClientTls(SSL_CTX* ctx, const TlsConfig& tls) {
  if (tls.ca_pem.empty()) {
    SSL_CTX_set_default_verify_paths(ctx);
  } else {
    std::unique_ptr<BIO, BioFree> bio(
        BIO_new_mem_buf(tls.ca_pem.data(), static_cast<int>(tls.ca_pem.size())));
    int added = 0;
    while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
      added += X509_STORE_add_cert(SSL_CTX_get_cert_store(ctx), cert) == 1 ? 1 : 0;
      X509_free(cert);
    }
    ERR_clear_error();  // the end of the PEM data
    if (added == 0) return absl::InvalidArgumentError("the TLS CA holds no certificate");
  }
  if (!tls.cert_pem.empty() && !tls.key_pem.empty()) {
    std::unique_ptr<BIO, BioFree> certs(
        BIO_new_mem_buf(tls.cert_pem.data(), static_cast<int>(tls.cert_pem.size())));
    X509* leaf = PEM_read_bio_X509(certs.get(), nullptr, nullptr, nullptr);
    const bool used = leaf != nullptr && SSL_CTX_use_certificate(ctx, leaf) == 1;
    X509_free(leaf);
    while (X509* extra = PEM_read_bio_X509(certs.get(), nullptr, nullptr, nullptr)) {
      if (SSL_CTX_add_extra_chain_cert(ctx, extra) != 1) X509_free(extra);
    }
    std::unique_ptr<BIO, BioFree> key(
        BIO_new_mem_buf(tls.key_pem.data(), static_cast<int>(tls.key_pem.size())));
    EVP_PKEY* pkey = PEM_read_bio_PrivateKey(key.get(), nullptr, nullptr, nullptr);
    const bool keyed = pkey != nullptr && SSL_CTX_use_PrivateKey(ctx, pkey) == 1;
    EVP_PKEY_free(pkey);
    if (!used || !keyed) {
      return absl::InvalidArgumentError(
          absl::StrCat("the TLS client certificate or key is unusable: ", OpenSslErrors()));
    }
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  return absl::OkStatus();
}

bool IsIpLiteral(const std::string& host) {
  unsigned char buf[16];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

// A TLS handshake on `fd` as gRPC's client makes it (ALPN h2, SNI, the
// server's name checked against its certificate when `verify`), then the
// HTTP/2 preface over it.
absl::StatusOr<TlsOutcome> TryTls(int fd, const TlsConfig* verify, const std::string& name) {
  TlsOutcome o;
  std::unique_ptr<SSL_CTX, SslCtxFree> ctx(SSL_CTX_new(TLS_client_method()));
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  if (verify != nullptr) {
    RETURN_IF_ERROR(UseClientTls(ctx.get(), *verify));
  } else {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  }
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_CTX_set_alpn_protos(ctx.get(), kAlpn, sizeof kAlpn);
  SSL_CTX_set_msg_callback(ctx.get(), OnTlsMessage);
  SSL_CTX_set_msg_callback_arg(ctx.get(), &o);
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(ctx.get()));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), fd) != 1) {
    return absl::InternalError("SSL_new failed");
  }
  const bool ip = IsIpLiteral(name);
  if (!ip) SSL_set_tlsext_host_name(ssl.get(), name.c_str());
  if (verify != nullptr) {
    if (ip) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), name.c_str());
    } else {
      SSL_set1_host(ssl.get(), name.c_str());
    }
  }
  ERR_clear_error();
  SigpipeBlocked no_sigpipe;
  if (SSL_connect(ssl.get()) != 1) {
    o.verify = SSL_get_verify_result(ssl.get());
    o.error = OpenSslErrors();
    return o;
  }
  o.handshake_done = true;
  // A TLS 1.3 server checks the client's certificate after the client has
  // finished its handshake: a refusal (an alert) comes with the first read.
  const std::string hello = ClientHello();
  if (SSL_write(ssl.get(), hello.data(), static_cast<int>(hello.size())) ==
      static_cast<int>(hello.size())) {
    o.http2 =
        ReadsSettingsFrame([&ssl](unsigned char* p, int n) { return SSL_read(ssl.get(), p, n); });
  }
  if (!o.http2) o.error = OpenSslErrors();
  return o;
}

absl::Status Mismatch(const std::string& message) { return absl::FailedPreconditionError(message); }

// The words for a TLS server that did not accept this client's handshake.
absl::Status TlsRefusal(const std::string& address, const TlsConfig& tls, const std::string& name,
                        const TlsOutcome& o, const ProbeNames& names) {
  const std::string failed = absl::StrCat("TLS handshake with ", address, " failed: ");
  if (o.verify == X509_V_ERR_HOSTNAME_MISMATCH || o.verify == X509_V_ERR_IP_ADDRESS_MISMATCH) {
    return Mismatch(absl::StrCat(
        failed, "the server's certificate is not issued for ", name, " (",
        X509_verify_cert_error_string(o.verify),
        "); connect by a name the certificate carries, or give that name as ", names.server_name));
  }
  if (o.verify != X509_V_OK) {
    return Mismatch(absl::StrCat(failed, "the server's certificate is not signed by ", names.ca,
                                 " (", X509_verify_cert_error_string(o.verify), ")"));
  }
  // A TLS 1.3 server checks the client's certificate after the client's
  // side of the handshake is done; gRPC's then closes the connection,
  // sending no alert.
  if (o.handshake_done && o.alert < 0 && o.certificate_requested) {
    return Mismatch(absl::StrCat(
        failed,
        tls.cert_pem.empty()
            ? "the server requires a client certificate (mutual TLS; it closed the connection "
              "after asking for one): give one its CA signed, with its key"
            : "the server refused this client's certificate (it closed the connection after "
              "the handshake): give one signed by the CA the server trusts"));
  }
  if (o.alert >= 0) {
    const std::string alert = SSL_alert_desc_string_long(o.alert);
    const bool about_certificates =
        o.alert == SSL_AD_BAD_CERTIFICATE || o.alert == SSL_AD_UNKNOWN_CA ||
        o.alert == SSL_AD_CERTIFICATE_UNKNOWN || o.alert == SSL_AD_ACCESS_DENIED ||
        o.alert == SSL_AD_HANDSHAKE_FAILURE || o.alert == SSL_AD_DECRYPT_ERROR;
    if (o.alert == SSL_AD_CERTIFICATE_REQUIRED || (tls.cert_pem.empty() && about_certificates)) {
      return Mismatch(absl::StrCat(failed,
                                   "the server requires a client certificate (mutual TLS; it "
                                   "answered: ",
                                   alert, "): give one its CA signed, with its key"));
    }
    if (about_certificates) {
      return Mismatch(absl::StrCat(failed, "the server refused this client's certificate (", alert,
                                   "): give one signed by the CA the server trusts"));
    }
    return Mismatch(absl::StrCat(failed, "the server answered: ", alert));
  }
  return Mismatch(absl::StrCat(failed, o.error.empty() ? "no reason given" : o.error));
}

}  // namespace

absl::Status ProbeEndpoint(const std::string& address, const TlsConfig& tls, absl::Duration timeout,
                           const ProbeNames& names) {
  absl::StatusOr<HostPort> hp = ParseHostPort(address);
  if (absl::IsNotFound(hp.status())) return absl::OkStatus();  // a gRPC scheme
  RETURN_IF_ERROR(hp.status());
  const absl::Time deadline = absl::Now() + timeout;
  // A connection with the time left; nullptr where none came in time.
  auto connect = [&]() -> absl::StatusOr<Socket> {
    absl::StatusOr<int> fd =
        ConnectTcp(address, std::max(deadline - absl::Now(), absl::Milliseconds(10)));
    if (absl::IsDeadlineExceeded(fd.status())) return Socket();
    RETURN_IF_ERROR(fd.status());
    SetTimeouts(*fd, deadline - absl::Now());
    return Socket(new int(*fd));
  };
  const std::string name = tls.server_name.empty() ? hp->host : tls.server_name;
  ASSIGN_OR_RETURN(Socket first, connect());
  if (first == nullptr) return absl::OkStatus();
  if (tls.enabled()) {
    ASSIGN_OR_RETURN(const TlsOutcome o, TryTls(*first, &tls, name));
    if (o.http2) return absl::OkStatus();
    if (o.server_spoke_tls) {
      // A finished handshake without HTTP/2, an alert or a request for a
      // client certificate is not this client's problem to name.
      if (o.handshake_done && o.alert < 0 && !o.certificate_requested) {
        return absl::OkStatus();
      }
      return TlsRefusal(address, tls, name, o, names);
    }
    // Not one TLS record came back: does the server speak plaintext?
    ASSIGN_OR_RETURN(Socket second, connect());
    if (second != nullptr && SpeaksPlaintextHttp2(*second)) {
      return Mismatch(absl::StrCat(address, " speaks plaintext, but a TLS CA was given (", names.ca,
                                   "): drop it, or start the servers with --tls_cert and "
                                   "--tls_key (docs/SECURITY.md)"));
    }
    return absl::OkStatus();
  }
  if (SpeaksPlaintextHttp2(*first)) return absl::OkStatus();
  ASSIGN_OR_RETURN(Socket second, connect());
  if (second == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const TlsOutcome o, TryTls(*second, nullptr, name));
  if (o.server_spoke_tls) {
    return Mismatch(
        absl::StrCat(address, " speaks TLS, but this client speaks plaintext: ", names.give_ca));
  }
  return absl::OkStatus();
}

}  // namespace auth
}  // namespace paramd
