# Sourced by the benchmarks that need the SmolLM-135M shape with random
# weights and a 40,960-token context: `ensure_smollm DIR WORKER_BINARY`
# writes DIR/smollm once (tiny-qwen3's tokenizer from tests/models).
ensure_smollm() {
  local dir=$1 worker=$2
  [ -f "$dir/smollm/config.json" ] && return 0
  "$worker" export-random --preset smollm-135m --tokenizer-from tests/models/tiny-qwen3 --out "$dir/smollm"
  python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['max_position_embeddings']=40960; json.dump(c,open(p,'w'))" \
    "$dir/smollm/config.json"
}
