"""hybrid_paramd against a cluster with TLS and bearer tokens
(docs/SECURITY.md): certificates by tools/make_certs.sh, a `ROLE TOKEN`
file given to every process. A plaintext client, a client trusting
another CA and one checking another server name are refused at once
(FailedPrecondition, in words); PARAMD_COORDINATOR, HPCTL_TLS_CA and
HPCTL_TOKEN_FILE are the defaults of address, tls_ca and token_file (as
hpctl's); no token is Unauthenticated; a
trainer token fetches and pushes but may not load (PermissionDenied); an
operator token (token_file, observer) streams a sharded load and steps; a
step pushed through TLS commits."""

import os
import subprocess
import tempfile
import time
import unittest

import test_env

import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import safetensors_io

TRAINER = "trainer-token-0123456789abcdef"
OPERATOR = "operator-token-0123456789abcdef"
CLUSTER = "cluster-token-0123456789abcdef"


class SecurityTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="hp_pysec_")
        cls.certs = os.path.join(cls.tmp, "certs")
        subprocess.run(["bash", os.path.join(test_env.ROOT, "tools", "make_certs.sh"), cls.certs],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=60)
        cls.tokens = os.path.join(cls.tmp, "tokens")
        with open(cls.tokens, "w") as f:
            f.write("# role token\ntrainer %s\noperator %s\ncluster %s\n" %
                    (TRAINER, OPERATOR, CLUSTER))
        os.chmod(cls.tokens, 0o600)
        c = cls.certs
        flags = ["--tls_cert=%s/server.pem" % c, "--tls_key=%s/server.key" % c,
                 "--tls_ca=%s/ca.pem" % c, "--auth_token_file=" + cls.tokens]
        cls.cluster = hpc.LocalCluster(test_env.SERVER, daemons=2, expected_pushers=1,
                                       coordinator_flags=flags,
                                       daemon_flags=flags + ["--optimizer=sgd", "--lr=0.5"])
        cls.ca = os.path.join(c, "ca.pem")
        g = torch.Generator().manual_seed(5)
        cls.model = {"a.weight": torch.randn(64, 32, generator=g),
                     "b.weight": torch.randn(48, 16, generator=g)}
        cls.model_dir = os.path.join(cls.tmp, "model")
        os.makedirs(cls.model_dir)
        safetensors_io.save(cls.model, os.path.join(cls.model_dir, "model.safetensors"))

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def operator(self):
        return hp.Client(self.cluster.address, observer=True, tls_ca=self.ca,
                         token_file=self.tokens, connect_timeout=10)

    def refused_at_once(self, words, **kwargs):
        start = time.monotonic()
        with self.assertRaises(hp.FailedPrecondition) as e:
            hp.Client(self.cluster.address, observer=True, token=OPERATOR, connect_timeout=30,
                      **kwargs)
        self.assertLess(time.monotonic() - start, 5)
        self.assertIn(words, e.exception.message)

    def test_tls_mistakes_are_named_at_once(self):
        addr = self.cluster.address
        self.refused_at_once(addr + " speaks TLS, but this client speaks plaintext")
        other = os.path.join(self.certs, "other-ca.pem")
        self.refused_at_once("TLS handshake with %s failed: the server's certificate is not "
                             "signed by the CA %s" % (addr, other), tls_ca=other)
        # The server certificate names 127.0.0.1 and localhost, not this.
        self.refused_at_once("the server's certificate is not issued for elsewhere.example.com",
                             tls_ca=self.ca, tls_server_name="elsewhere.example.com")

    def test_environment_gives_address_ca_and_token_file(self):
        os.environ["PARAMD_COORDINATOR"] = self.cluster.address
        os.environ["HPCTL_TLS_CA"] = self.ca
        try:
            with self.assertRaises(hp.Unauthenticated):  # no token anywhere
                hp.Client(observer=True)
            with hp.Client(observer=True, token_file=self.tokens) as c:
                self.assertIsNotNone(c.manifest())
            os.environ["HPCTL_TOKEN_FILE"] = self.tokens
            with hp.Client(observer=True) as c:  # everything from the environment
                self.assertIsNotNone(c.manifest())
        finally:
            del os.environ["PARAMD_COORDINATOR"]
            del os.environ["HPCTL_TLS_CA"]
            os.environ.pop("HPCTL_TOKEN_FILE", None)

    def test_roles_over_tls(self):
        addr = self.cluster.address
        with self.assertRaises(hp.Unauthenticated):
            hp.Client(addr, observer=True, tls_ca=self.ca)
        with self.assertRaises(hp.Unauthenticated):
            hp.Client(addr, observer=True, tls_ca=self.ca, token="unknown-token-0123456789")
        admin = self.operator()
        seen = []
        v = hpc.load_when_ready(admin, self.model_dir, None, force=True,
                                progress=lambda s, t: seen.append((s, t)))
        self.assertEqual(v, 0)
        self.assertEqual(seen[-1][0], seen[-1][1])
        self.assertEqual(sorted(admin.manifest().names()), ["a.weight", "b.weight"])
        self.assertIn("members", admin.status())

        # A trainer (bare token, mutual-TLS client certificate accepted too).
        t = hp.Client(addr, tls_ca=self.ca, token=TRAINER,
                      tls_cert=os.path.join(self.certs, "client.pem"),
                      tls_key=os.path.join(self.certs, "client.key"))
        r = t.fetch(0, directions=["rowwise", "columnwise"])
        self.assertEqual(len(r), 4)
        with self.assertRaises(hp.PermissionDenied) as e:
            t.load(os.path.join(self.model_dir, "model.safetensors"), force=True, stream=True)
        self.assertNotIn(TRAINER, str(e.exception))
        with self.assertRaises(hp.PermissionDenied):
            t.set_optimizer_schedule({"warmup_steps": 1})
        with self.assertRaises(hp.PermissionDenied):
            t.status()
        t.push_gradients(0, {n: torch.ones_like(w) for n, w in self.model.items()})
        self.assertEqual(t.wait_for_version(1), 1)
        after = t.fetch(1, names=["a.weight"])["a.weight"].dequantize()
        before = r["a.weight", "rowwise"].dequantize()
        self.assertFalse(torch.equal(after, before))
        # An operator may not push.
        with self.assertRaises(hp.PermissionDenied):
            admin.push_gradients(1, {"a.weight": torch.ones(64, 32)}, partial=True)
        t.close()
        admin.close()


if __name__ == "__main__":
    unittest.main()
