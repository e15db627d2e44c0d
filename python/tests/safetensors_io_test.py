"""hybrid_paramd.safetensors_io: files written by it round-trip bit for
bit (every dtype, empty and unaligned tensors, metadata), the C++ reader
(hpctl inspect) reads them, and without the `safetensors` package the
reader maps the file copy-on-write (a tensor written to leaves the file
unchanged). Where the package is installed, its reading equals the
fallback's."""

import os
import subprocess
import unittest

import test_env  # noqa: F401  (sys.path)

import torch

from hybrid_paramd import safetensors_io as st


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def tensors():
    g = torch.Generator().manual_seed(2)
    return {
        "w": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, generator=g).half(),
        "b": torch.randn(4, 2, generator=g).bfloat16(),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "f64": torch.linspace(0, 1, 3, dtype=torch.float64),
        "byte": torch.tensor([1, 2, 3], dtype=torch.uint8),  # the next tensor starts unaligned
        "after": torch.randn(3, generator=g),
        "empty": torch.empty(0, 4),
    }


class SafetensorsIoTest(unittest.TestCase):

    def setUp(self):
        self.dir = test_env.tmpdir("hp_st_")

    def round_trip(self, read):
        path = os.path.join(self.dir, "t.safetensors")
        want = tensors()
        st.save(want, path, metadata={"format": "pt", "step": 3})
        got, meta = read(path)
        self.assertEqual(meta, {"format": "pt", "step": "3"})
        self.assertEqual(sorted(got), sorted(want))
        for n, t in want.items():
            self.assertEqual(got[n].dtype, t.dtype, n)
            self.assertEqual(tuple(got[n].shape), tuple(t.shape), n)
            self.assertTrue(torch.equal(got[n], t), n)
        return path, got

    def test_round_trip(self):
        self.round_trip(st.load)

    def test_the_fallback_maps_the_file_copy_on_write(self):
        saved = (st._safe_open, st._save_file)
        st._safe_open = st._save_file = None
        try:
            path, got = self.round_trip(st.load)
            before = file_bytes(path)
            got["w"].fill_(7.0)
            got["ids"].zero_()
            self.assertEqual(file_bytes(path), before)
            again, _ = st.load(path)
            self.assertTrue(torch.equal(again["w"], tensors()["w"]))
        finally:
            st._safe_open, st._save_file = saved

    def test_hpctl_reads_what_it_wrote(self):
        hpctl = os.environ.get("PARAMD_HPCTL")
        if not hpctl:
            self.skipTest("PARAMD_HPCTL not set (run through Bazel)")
        path = os.path.join(self.dir, "m.safetensors")
        st.save({"layer.weight": torch.randn(16, 8), "norm": torch.ones(8)}, path)
        out = subprocess.run([hpctl, "inspect", path], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("layer.weight", out.stdout)

    @unittest.skipUnless(st.uses_safetensors_package(),
                         "the safetensors package is not installed here (Debian 12 does not "
                         "package it); its path is compared where it is")
    def test_the_package_and_the_fallback_agree(self):
        path, got = self.round_trip(st.load)
        saved = (st._safe_open, st._save_file)
        st._safe_open = st._save_file = None
        try:
            fallback, _ = st.load(path)
        finally:
            st._safe_open, st._save_file = saved
        for n, t in got.items():
            self.assertTrue(torch.equal(fallback[n], t), n)


if __name__ == "__main__":
    unittest.main(verbosity=2)
