source scripts/device_env.sh call3
full_configs
stamp "graphs + syncs"
timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py -k "graph or syncs" 2>&1 | grep -v "Warning\|warn" | tail -8
stamp "fast path fp32 fp8 with stack dumps"
timeout 130 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py -k "fast_path and dtype0-fp8" -o faulthandler_timeout=45 > $OUT/fp8fp32.log 2>&1
echo "rc $?"; grep -n "File \"/" $OUT/fp8fp32.log | grep -v "_pytest\|pluggy" | head -30
stamp "gate fp8"
TAILORED_COMMIT=94ae872 timeout 280 python3 -m tailored gate /tmp/full-fp8 --load-format dummy --device cuda --dtype bfloat16 --report $OUT/gate-fp8.json --log-level info 2>&1 | grep -v "Warning\|warn" | tail -14
stamp done
