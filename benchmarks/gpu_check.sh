#!/usr/bin/env bash
# The path the developers' guide names; the script lives with the other GPU benchmarks.
exec bash "$(dirname "$0")/gpu/gpu_check.sh" "$@"
