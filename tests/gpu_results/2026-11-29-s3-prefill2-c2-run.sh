#!/bin/bash
# prefill helper 2, device call 2 (the warm machine of call 1, right after it): the persistent kernel's
# source tree of call 1 with kPrefillSm90Persistent = false (its non-persistent mode), hd128 bench only.
cd /tmp/P 2>/dev/null || { mkdir -p /tmp/P && tar -xf /root/*/.snap_prefill2/new.tar -C /tmp/P; cd /tmp/P; }; sed -i 's/constexpr bool kPrefillSm90Persistent = true;/constexpr bool kPrefillSm90Persistent = false;/' templates/prefill_sm90.cuh; grep -c "Persistent = false" templates/prefill_sm90.cuh; PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/P:/tmp/site JITATTN_CACHE_DIR=/tmp/jcNP timeout 40 python3 -m jitattn bench --case prefill-hd128-causal-b4x8192 --anchors '' --json $OUT/bench-NP.json 2>&1 | grep "^| prefill"
