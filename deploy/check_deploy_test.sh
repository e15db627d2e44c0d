#!/usr/bin/env bash
# Runs deploy/check_deploy.py with the test's arguments (//deploy:*_check).
exec python3 deploy/check_deploy.py "$@"
