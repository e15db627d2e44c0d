#!/usr/bin/env python3
"""The documentation test: runs the shell blocks of README.md and
deploy/README.md, so that a command the docs give that does not work fails
CI (a step of tools/test.sh, outside Bazel: the blocks run bazel).

Every fenced block whose language is a shell (sh, bash, shell, console, ...)
or is missing carries a marker on the line right before its fence:

  <!-- doc-test: run -->              each command runs; each must exit 0
  <!-- doc-test: skip: REASON -->     not run here (REASON: what this machine
                                      lacks); each command is checked: the
                                      repository paths and Bazel labels it
                                      names exist, the flags it gives
                                      hybrid-paramd / hybrid-paramd-health
                                      are theirs, `hpctl SUBCOMMAND --flag`
                                      exists
  <!-- doc-test: output: COMMAND -->  the block is what COMMAND (run by a run
                                      block above) prints: each line must be
                                      in its output, in order; numbers must be
                                      equal except durations (a number before
                                      ms, s, us, min or h)
  <!-- doc-test: text: WHAT -->       not commands (a recipe, a diagram)

A block without a marker, a marker that is not right above a fence, and an
unknown decision are failures naming the file and line. Blocks of other
languages (python, c++) take no marker and are not run.

How a run block runs: one bash process per block (pipefail on), command by
command (a command is a line with its continuations, or a multi-line
subshell, loop or quote); the first command that exits non-zero fails the
block, named by file and line, with the end of its output. A console block's
`$ ` lines are its commands and the lines below each are its expected output
(compared as an output block). Commands run in a scratch directory that
holds a link to each top-level entry of the repository (so `tools/...`,
`deploy/...` and `bazel-bin/...` resolve and what a command writes lands in
the scratch directory), with HOME, TMPDIR and every `/tmp/` in a command
moved into it; `bazel` is a wrapper that runs the real one at the
repository root with the real HOME, PATH and TMPDIR (one output base, and
Bazel's actions inherit PATH: nothing is rebuilt);
hybrid-paramd, hpctl and hybrid-paramd-health are on PATH. When a block
ends, whatever it left running (its process group) is killed.

The test command (`bash tools/test.sh` or `.ci/run`, which run this test)
is not run: it must be exactly the command .ci/run runs (or `bash .ci/run`).
A command ending in --help or --helpfull passes with exit status 1 too
(Abseil's --help exits 1) when it printed flags; it is noted.

Usage: tools/doc_test.py [--root DIR] [--bin_dir DIR] [--no_run] [--list]
                         [--timeout SECONDS] [--keep] [FILE.md ...]
  FILE.md     default README.md deploy/README.md (relative to --root)
  --root      the repository (default: the one this script is in)
  --bin_dir   a directory with hybrid-paramd, hpctl and hybrid-paramd-health
              (default: bazel build them at --root)
  --no_run    check markers and skipped blocks only; run nothing
  --list      print each block's decision and exit
  --timeout   seconds a run block may take (default 600)
  --keep      keep the scratch directory
Exit status 0 if every block passed.
"""

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SHELL_LANGS = {"", "sh", "bash", "shell", "console", "zsh", "shell-session", "sh-session",
               "shellsession", "terminal"}
DECISIONS = ("run", "skip", "output", "text")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`{]*)")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
# Words that run the next word as the command.
PREFIX_COMMANDS = {"sudo", "env", "exec", "time", "nohup", "command", "!"}
SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")", ";;", "|&"}
# Compound commands: what opens and closes one, where a command may start.
KEYWORD_DEPTH = {"do": 1, "done": -1, "if": 1, "fi": -1, "case": 1, "esac": -1, "{": 1, "}": -1}
COMMAND_POSITION = {"then", "do", "else", "elif", "{", "!"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FLAG = re.compile(r"^--([A-Za-z0-9_]+)(?:=(.*))?$", re.S)
LABEL = re.compile(r"^//([A-Za-z0-9_./-]*)(?::([A-Za-z0-9_.+@-]+))?$")
DURATION_AFTER = re.compile(r"^\s*(ms|s|us|µs|min|h)\b")


class Block:
    def __init__(self, path, line, lang, lines, decision, arg):
        self.path = path          # as given (relative to the root)
        self.line = line          # 1-based line of the opening fence
        self.lang = lang
        self.lines = lines        # the content, indentation of the fence removed
        self.decision = decision  # run / skip / output / text, or None
        self.arg = arg            # the reason / command / description

    def where(self, index=-1):
        """FILE:LINE of the fence, or of content line `index` (0-based)."""
        return f"{self.path}:{self.line + 1 + index}"


class Command:
    def __init__(self, index, text):
        self.index = index        # 0-based line in the block
        self.text = text
        self.expected = []        # console blocks: the lines shown below it


def parse_marker(text):
    """'run' / 'skip: why' -> (decision, argument); an unknown one -> (None, message)."""
    decision, _, arg = text.partition(":")
    decision, arg = decision.strip(), arg.strip()
    if decision not in DECISIONS:
        return None, f"unknown doc-test decision {text!r} (one of: run, skip: REASON, " \
                     f"output: COMMAND, text: WHAT)"
    if decision == "run" and arg:
        return None, f"'run' takes nothing after it: {text!r}"
    if decision != "run" and not arg:
        return None, f"'{decision}' needs what follows the colon (the reason, command or " \
                     f"what the block holds): {text!r}"
    return decision, arg


def parse_markdown(path, text):
    """The fenced blocks of a markdown text, and the marker problems."""
    lines = text.splitlines()
    blocks, problems = [], []
    markers_used = set()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start = i
        i += 1
        content = []
        while i < len(lines):
            s = lines[i].strip()
            if s.startswith(fence[0] * len(fence)) and not s.strip(fence[0]):
                break
            line = lines[i]
            content.append(line[indent:] if line[:indent].isspace() or not indent else line.lstrip())
            i += 1
        i += 1
        decision = arg = None
        prev = lines[start - 1] if start > 0 else ""
        mm = MARKER.match(prev)
        if mm:
            markers_used.add(start - 1)
            decision, arg = parse_marker(mm.group(1))
            if decision is None:
                problems.append(f"{path}:{start}: {arg}")
        elif "doc-test" in prev:
            problems.append(f"{path}:{start}: not a doc-test marker (want "
                            f"'<!-- doc-test: DECISION -->' alone on the line): {prev.strip()!r}")
        block = Block(path, start + 1, lang, content, decision, arg)
        if lang in SHELL_LANGS:
            if mm is None and "doc-test" not in prev:
                kind = f"a {lang} block" if lang else "a block without a language"
                problems.append(f"{path}:{start + 1}: {kind} without a doc-test marker on the "
                                f"line before it (<!-- doc-test: run -->, <!-- doc-test: skip: "
                                f"REASON -->, <!-- doc-test: output: COMMAND --> or "
                                f"<!-- doc-test: text: WHAT -->)")
        elif mm:
            problems.append(f"{path}:{start}: a doc-test marker on a {lang} block (only shell "
                            f"blocks and blocks without a language take one)")
            block.decision = None
        if block.decision in ("run", "skip") and not lang:
            problems.append(f"{path}:{start + 1}: '{block.decision}' on a block without a "
                            f"language: give it one (```sh)")
            block.decision = None
        blocks.append(block)
    for n, line in enumerate(lines):
        if MARKER.match(line) and n not in markers_used:
            problems.append(f"{path}:{n + 1}: a doc-test marker that is not on the line right "
                            f"before a fence")
    return blocks, problems


def lex(text):
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def is_complete(text):
    """Whether text is a whole command (no open quote, parenthesis, loop,
    if, case or brace group; no trailing && || |)."""
    try:
        tokens = lex(text.replace("\\\n", " ").replace("\n", " ; "))
    except ValueError:
        return False
    while tokens and tokens[-1] == ";":
        tokens.pop()
    depth, prev = 0, None
    for t in tokens:
        if t and not t.strip("();<>|&"):
            depth += t.count("(") - t.count(")")
        if prev is None or prev in SEPARATORS or prev in COMMAND_POSITION:
            depth += KEYWORD_DEPTH.get(t, 0)
        prev = t
    return depth <= 0 and not (tokens and tokens[-1] in ("&&", "||", "|", "|&"))


def split_commands(lines):
    """The commands of a shell block: (0-based line, text) for each line with
    its continuations; blank and comment-only lines are left out."""
    commands, buf, start = [], [], 0
    for i, line in enumerate(lines):
        if not buf and (not line.strip() or line.strip().startswith("#")):
            continue
        if not buf:
            start = i
        buf.append(line)
        if line.rstrip().endswith("\\") or not is_complete("\n".join(buf)):
            continue
        commands.append(Command(start, "\n".join(buf)))
        buf = []
    if buf:
        commands.append(Command(start, "\n".join(buf)))
    return commands


def console_commands(lines):
    """A console block: `$ ` lines (and their continuations) are commands, the
    lines below each its expected output."""
    commands, cont = [], False
    for i, line in enumerate(lines):
        if cont:
            commands[-1].text += "\n" + line
        elif line.startswith("$ ") or line == "$":
            commands.append(Command(i, line[2:]))
        elif commands and line.strip():
            commands[-1].expected.append(line)
            continue
        else:
            continue
        cont = line.rstrip().endswith("\\") or not is_complete(commands[-1].text)
    return commands


def block_commands(block):
    return console_commands(block.lines) if block.lang == "console" else split_commands(block.lines)


def normalize(command):
    """A command as words joined by one space, comments and continuations gone."""
    try:
        return " ".join(lex(command.replace("\\\n", " ")))
    except ValueError:
        return " ".join(command.split())


def shown(command):
    """A command as the doc has it, on one line, without its comments (for
    messages)."""
    lines = []
    for line in command.replace("\\\n", " ").splitlines():
        for m in re.finditer(r"(^|\s)#", line):
            head = line[:m.start()]
            if head.count("'") % 2 == 0 and head.count('"') % 2 == 0:
                line = head
                break
        lines.append(line)
    return " ".join(" ".join(lines).split())


def simple_commands(text):
    """The simple commands of a command text, as word lists (for the static
    checks): split at operators and line ends; [optional] brackets removed."""
    try:
        tokens = lex(text.replace("\\\n", " ").replace("\n", " ; "))
    except ValueError:
        return []
    out, cur = [], []
    for t in tokens:
        if t in SEPARATORS or (t and not t.strip("();|&")):
            if cur:
                out.append(cur)
            cur = []
        elif set(t) <= set("<>&") and ("<" in t or ">" in t):
            cur.append(None)  # a redirection: its target is not an argument
        else:
            cur.append(t.strip("[]"))
    if cur:
        out.append(cur)
    words = [[w for i, w in enumerate(c) if w is not None and (i == 0 or c[i - 1] is not None)]
             for c in out]
    return [w for w in words if w]


def command_word(words):
    """(index, word) of the command a simple command runs."""
    for i, w in enumerate(words):
        if ASSIGNMENT.match(w) or w in PREFIX_COMMANDS or (i > 0 and words[i - 1] == "sudo"
                                                          and w.startswith("-")):
            continue
        return i, w
    return len(words), None


# ---------------------------------------------------------------- expected output

def line_pattern(expected):
    """A regex for one expected output line: its words and numbers exactly,
    except durations (a number before ms, s, ...), and any run of spaces."""
    parts = re.split(r"(\d+(?:\.\d+)?)", expected.strip())
    rx = ""
    for i, part in enumerate(parts):
        if i % 2 == 0:
            rx += r"\s+".join(re.escape(w) for w in re.split(r"\s+", part))
        elif i + 1 < len(parts) and DURATION_AFTER.match(parts[i + 1]):
            rx += r"\d+(?:\.\d+)?"
        else:
            rx += re.escape(part)
    return re.compile(rx)


def compare_output(expected_lines, output, where, what):
    """Problems: expected lines missing from output (in order)."""
    got = [l.strip() for l in output.splitlines()]
    pos = 0
    for n, line in expected_lines:
        if not line.strip():
            continue
        rx = line_pattern(line)
        for k in range(pos, len(got)):
            if rx.fullmatch(got[k]):
                pos = k + 1
                break
        else:
            head = re.split(r"\d", line.strip(), 1)[0]
            near = [g for g in got if head and g.startswith(head)]
            hint = f"; the output has: {near[-1]!r}" if near else ""
            return [f"{where(n)}: {what} did not print {line.strip()!r}{hint}"]
    return []


# ---------------------------------------------------------------- static checks

class Tools:
    """hybrid-paramd, hpctl and hybrid-paramd-health: their flags and commands."""

    def __init__(self, root, bin_dir):
        self.root, self.bin_dir = root, bin_dir
        self.cache = {}

    def binary(self, name):
        if self.bin_dir is None:
            build_binaries(self.root)
            self.bin_dir = os.path.join(self.root, "bazel-bin")
        flat = os.path.join(self.bin_dir, name)
        nested = {"hybrid-paramd": "server/hybrid-paramd", "hpctl": "hpctl/hpctl",
                  "hybrid-paramd-health": "deploy/hybrid-paramd-health"}[name]
        return os.path.abspath(flat if os.path.isfile(flat) else os.path.join(self.bin_dir, nested))

    def help_text(self, name, *args):
        key = (name,) + args
        if key not in self.cache:
            r = subprocess.run([self.binary(name), *args], capture_output=True, text=True,
                               timeout=60)
            self.cache[key] = (r.returncode, r.stdout + r.stderr)
        return self.cache[key]

    def absl_flags(self, name):
        _, text = self.help_text(name, "--helpfull")
        flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+)\b", text, re.M))
        if len(flags) < 5:
            raise RuntimeError(f"could not read the flags of {name} --helpfull:\n{text[:1000]}")
        return flags | {"help", "helpfull", "helpshort", "version"}

    def hpctl_commands(self):
        _, text = self.help_text("hpctl", "--help")
        section = text.split("Commands:", 1)[-1]
        commands = set(re.findall(r"^  ([a-z][a-z0-9_-]*)\s", section, re.M))
        if len(commands) < 3:
            raise RuntimeError(f"could not read the commands of hpctl --help:\n{text[:1000]}")
        return commands, text


def build_binaries(root):
    print("doc test: bazel build //server:hybrid-paramd //hpctl //deploy:hybrid-paramd-health",
          flush=True)
    r = subprocess.run(["bazel", "build", "--noshow_progress", "//server:hybrid-paramd",
                        "//hpctl", "//deploy:hybrid-paramd-health"], cwd=root,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"doc test: the build failed:\n{r.stderr[-3000:]}")


def check_flag_words(words, known, tool, where):
    problems = []
    for w in words:
        m = FLAG.match(w)
        if not m:
            continue
        name = m.group(1)
        if name not in known and not (name.startswith("no") and name[2:] in known):
            problems.append(f"{where}: {tool} has no flag --{name}")
    return problems


def check_label(root, word, where):
    m = LABEL.match(word)
    package, name = m.group(1), m.group(2)
    if package == "..." or package.endswith("/..."):
        d = os.path.join(root, package[:-3])
        return [] if os.path.isdir(d) else [f"{where}: no package directory for {word}"]
    build = next((os.path.join(root, package, b) for b in ("BUILD", "BUILD.bazel")
                  if os.path.isfile(os.path.join(root, package, b))), None)
    if build is None:
        return [f"{where}: {word}: no BUILD file in {package or 'the root'}"]
    name = name or os.path.basename(package)
    text = open(build).read()
    if re.search(r"\bname\s*=\s*\"%s\"" % re.escape(name), text) or \
            os.path.exists(os.path.join(root, package, name)):
        return []
    return [f"{where}: {word}: {os.path.relpath(build, root)} defines no target {name}"]


def path_candidates(word):
    """The words (and flag/assignment values) that may name repository paths."""
    m = re.match(r"^--?[A-Za-z0-9_-]+=(.*)$", word, re.S)
    if m:
        word = m.group(1)
    elif ASSIGNMENT.match(word):
        word = word.split("=", 1)[1]
    return [word] if word else []


def check_paths(root, words, where, top):
    problems = []
    for w in words:
        if LABEL.match(w):
            problems += check_label(root, w, where)
            continue
        for p in path_candidates(w):
            if "/" not in p or p[0] in "/-~$." or any(c in p for c in "$:{}<>|"):
                continue
            first = p.split("/", 1)[0]
            if first.startswith("bazel-") and first in top:
                parts = p.rstrip("/").split("/")
                if len(parts) >= 3 and first == "bazel-bin":
                    problems += check_label(root, "//%s:%s" % ("/".join(parts[1:-1]), parts[-1]),
                                            where)
            elif first in top and not glob.glob(os.path.join(glob.escape(root), p)):
                problems.append(f"{where}: {p}: no such file in the repository")
    return problems


def check_static(root, tools, text, where):
    """The checks of a skipped command: paths, labels, flags, hpctl commands."""
    top = set(os.listdir(root)) - {".git"}
    problems = []
    for words in simple_commands(text):
        problems += check_paths(root, words, where, top)
        ci, cmd = command_word(words)
        base = os.path.basename(cmd or "")
        if base == "hpctl":
            rest = words[ci + 1:]
            sub = next((w for w in rest if not w.startswith("-")), None)
            commands, top_help = tools.hpctl_commands()
            if sub is None:   # hpctl --version, hpctl --help
                problems += [f"{where}: hpctl has no option {w}" for w in rest
                             if FLAG.match(w) and w.split("=")[0] not in top_help]
                continue
            if sub not in commands:
                problems.append(f"{where}: hpctl has no command {sub!r} (hpctl --help: "
                                f"{', '.join(sorted(commands))})")
                continue
            _, sub_help = tools.help_text("hpctl", sub, "--help")
            known = set(re.findall(r"--([A-Za-z0-9_]+)", sub_help)) | {"help"}
            problems += check_flag_words(rest, known, f"hpctl {sub}", where)
        elif base == "hybrid-paramd-health":
            problems += check_flag_words(words[ci + 1:], tools.absl_flags(base), base, where)
        # hybrid-paramd: as the command, or as the image of `docker run`.
        for i, w in enumerate(words):
            if not ASSIGNMENT.match(w) and os.path.basename(w) == "hybrid-paramd":
                problems += check_flag_words(words[i + 1:], tools.absl_flags("hybrid-paramd"),
                                             "hybrid-paramd", where)
                break
    return problems


# ---------------------------------------------------------------- running

class Scratch:
    """The directory run blocks run in (see the top of this file)."""

    def __init__(self, root, tools, keep):
        self.dir = tempfile.mkdtemp(prefix="doc-test-")
        self.keep = keep
        self.work = os.path.join(self.dir, "work")
        self.tmp = os.path.join(self.dir, "tmp")
        home = os.path.join(self.dir, "home")
        bin_dir = os.path.join(self.dir, "bin")
        for d in (self.work, self.tmp, home, bin_dir):
            os.makedirs(d)
        for entry in os.listdir(root):
            if entry != ".git":
                os.symlink(os.path.join(root, entry), os.path.join(self.work, entry))
        real_bazel = shutil.which("bazel")
        if real_bazel:
            wrapper = os.path.join(bin_dir, "bazel")
            # The real HOME (one output base), PATH and TMPDIR: Bazel's
            # actions inherit PATH, so another one would rebuild everything.
            tmpdir = os.environ.get("TMPDIR")
            restore = (f"TMPDIR={shlex.quote(tmpdir)}" if tmpdir is not None else "-u TMPDIR")
            with open(wrapper, "w") as f:
                f.write("#!/bin/sh\n# doc test: the real bazel, at the repository root, in the "
                        "environment the test started in (one output base, nothing rebuilt)\n"
                        f"cd {shlex.quote(root)} && exec env {restore} "
                        f"HOME={shlex.quote(os.path.expanduser('~'))} "
                        f"PATH={shlex.quote(os.environ.get('PATH', ''))} "
                        f"{shlex.quote(real_bazel)} \"$@\"\n")
            os.chmod(wrapper, 0o755)
        if tools is not None:
            for name in ("hybrid-paramd", "hpctl", "hybrid-paramd-health"):
                target = tools.binary(name)
                if os.path.exists(target):
                    os.symlink(os.path.abspath(target), os.path.join(bin_dir, name))
        self.env = dict(os.environ, HOME=home, TMPDIR=self.tmp, HYBRID_PARAMD_DOC_TEST="1",
                        PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))

    def rewrite(self, command):
        return re.sub(r"(?<![\w.~-])/tmp/", self.tmp + "/", command)

    def close(self):
        if self.keep:
            print(f"doc test: scratch directory kept: {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def ci_command(root):
    """The command .ci/run runs (its exec line), as words."""
    path = os.path.join(root, ".ci", "run")
    if not os.path.exists(path):
        return None
    execs = re.findall(r"^\s*exec\s+(.+?)\s*$", open(path).read(), re.M)
    return normalize(execs[-1]) if execs else None


def test_command_problem(root, command, where):
    """None if command is not the test command; '' if it is the right one;
    else the problem."""
    words = normalize(command).split()
    if words and words[0] in ("bash", "sh"):
        words = words[1:]
    if not words or os.path.normpath(words[0]) not in (".ci/run", "tools/test.sh"):
        return None
    ci = ci_command(root)
    if ci is None:
        return f"{where}: the test command {normalize(command)!r}: .ci/run has no exec line"
    if normalize(command) in (ci, "bash .ci/run"):
        return ""
    return (f"{where}: the test command {normalize(command)!r} is not what .ci/run runs "
            f"({ci!r})")


def is_help(command):
    words = normalize(command).split()
    return bool(words) and words[-1] in ("--help", "--helpfull")


def run_block(block, commands, scratch, timeout):
    """Runs a block's commands in one bash; returns (problems, notes, the
    output of each command that passed, by index)."""
    problems, notes = [], []
    script = ["set -o pipefail"]
    for n, c in enumerate(commands):
        script.append(f"printf '\\n\\036doc-test %d\\n' {n}")
        script.append(scratch.rewrite(c.text))
        script.append(f"__rc=$?; printf '\\n\\036doc-test-rc %d %d\\n' {n} $__rc; "
                      f"[ $__rc -eq 0 ] || {'[ $__rc -eq 1 ] ||' if is_help(c.text) else ''} "
                      f"exit 0")
    log_path = os.path.join(scratch.dir, "block.log")
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=scratch.work,
                                env=scratch.env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)
        log.seek(0)
        text = log.read()
    outputs, status, passed = {}, {}, {}
    for m in re.finditer(r"\x1edoc-test (\d+)\n(.*?)(?=\n?\x1edoc-test|\Z)", text, re.S):
        outputs[int(m.group(1))] = m.group(2)
    for m in re.finditer(r"\x1edoc-test-rc (\d+) (\d+)", text):
        status[int(m.group(1))] = int(m.group(2))
    for n, c in enumerate(commands):
        where, out = block.where(c.index), outputs.get(n, "")
        tail = "\n".join("    " + l for l in out.rstrip().splitlines()[-25:])
        if n not in status:
            why = f"timed out after {timeout:g} s" if timed_out else "the shell exited"
            problems.append(f"{where}: `{shown(c.text)}`: {why}; its output ends:\n{tail}")
            break
        if status[n] == 1 and is_help(c.text) and re.search(r"--[a-z]", out):
            notes.append(f"{where}: `{shown(c.text)}` printed its flags and exited 1 "
                         f"(Abseil's --help)")
        elif status[n] != 0:
            problems.append(f"{where}: `{shown(c.text)}` exited {status[n]}; its output "
                            f"ends:\n{tail}")
            break
        passed[n] = out
    return problems, notes, passed


def kill_group(proc):
    """Ends the block's shell and whatever it started (its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + 5
        while group_alive(proc) and time.time() < deadline:
            time.sleep(0.05)
        if not group_alive(proc):
            break
    proc.wait()


def group_alive(proc):
    """Whether a process of proc's group still runs (zombies do not count)."""
    proc.poll()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(proc.pid) and fields[0] != "Z":
            return True
    return False


# ---------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=["README.md", "deploy/README.md"])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--bin_dir")
    ap.add_argument("--no_run", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.root)
    started = time.time()

    problems, blocks = [], []
    for f in args.files:
        full = f if os.path.isabs(f) else os.path.join(root, f)
        found, p = parse_markdown(f, open(full).read())
        blocks += found
        problems += p
    if args.list:
        for b in blocks:
            print(f"{b.where()} {b.lang or '(no language)'}: {b.decision or '-'}"
                  f"{': ' + b.arg if b.arg else ''}")
        return 0

    # Killed (CI's timeout, ^C): end the running block and remove the scratch
    # directory on the way out (the finally clauses below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tools = Tools(root, args.bin_dir)
    scratch = None if args.no_run else Scratch(root, tools, args.keep)
    outputs = {}   # normalized command -> its output (the latest run)
    counts = dict.fromkeys(DECISIONS, 0)
    try:
        for b in blocks:
            if b.decision is None:
                continue
            counts[b.decision] += 1
            commands = block_commands(b) if b.decision in ("run", "skip") else []
            if b.decision == "skip":
                for c in commands:
                    problems += check_static(root, tools, c.text, b.where(c.index))
                print(f"{b.where()}: skipped ({b.arg}); {len(commands)} commands checked",
                      flush=True)
            elif b.decision == "run":
                to_run = []
                for c in commands:
                    test = test_command_problem(root, c.text, b.where(c.index))
                    if test is None:
                        to_run.append(c)
                    elif test:
                        problems.append(test)
                    else:
                        print(f"{b.where(c.index)}: `{shown(c.text)}` is the test command "
                              f"(what .ci/run runs): not run here", flush=True)
                if args.no_run or not to_run:
                    continue
                t0 = time.time()
                p, notes, out = run_block(b, to_run, scratch, args.timeout)
                problems += p
                for n, c in enumerate(to_run):
                    if n in out:
                        outputs[normalize(c.text)] = out[n]
                        if c.expected:
                            problems += compare_output(
                                [(c.index + 1 + k, l) for k, l in enumerate(c.expected)],
                                out[n], b.where, f"`{shown(c.text)}`")
                for note in notes:
                    print(f"{note}", flush=True)
                print(f"{b.where()}: ran {len(to_run)} commands in {time.time() - t0:.1f} s"
                      f"{': FAILED' if p else ''}", flush=True)
            elif b.decision == "output" and not args.no_run:
                key = normalize(b.arg)
                if key not in outputs:
                    problems.append(f"{b.where()}: the output of `{b.arg}`, which no run block "
                                    f"above ran to the end (or it failed)")
                    continue
                problems += compare_output(list(enumerate(b.lines)), outputs[key], b.where,
                                           f"`{b.arg}`")
    finally:
        if scratch:
            scratch.close()
    for p in problems:
        print(f"FAIL {p}")
    print(f"doc test: {', '.join(f'{v} {k}' for k, v in counts.items())} blocks"
          f"{' (nothing run: --no_run)' if args.no_run else ''}; {len(problems)} problems; "
          f"{time.time() - started:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
