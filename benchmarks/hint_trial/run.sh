#!/usr/bin/env bash
# The hint trial of issue 26 (docs/verdicts.md, "Known mistakes, named"): 57 bugs written cold by a helper session
# (KEY.md: each one's true cause) and 6 correct implementations. Reruns every scenario file into out_<file>.txt;
# GRADES.md is the grading of commit 2dba174's hints against KEY.md (R: right cause, N: none, W: wrong).
# Needs torch and jax (pip install -e '.[torch,jax]').
cd "$(dirname "$0")"
for f in set_*.yaml; do
  attn-gradcheck run "$f" --jobs 1 > "out_${f%.yaml}.txt" 2>&1
  echo "$f: exit $?"
done
