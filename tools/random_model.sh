# Sourced by the benchmarks that need a model shape with random weights and
# a 40,960-token context: `ensure_random DIR WORKER_BINARY PRESET NAME`
# writes DIR/NAME once (tiny-qwen3's tokenizer from tests/models; prompts
# are token ids).
ensure_random() {
  local dir=$1 worker=$2 preset=$3 name=$4
  [ -f "$dir/$name/config.json" ] && return 0
  "$worker" export-random --preset "$preset" --tokenizer-from tests/models/tiny-qwen3 --out "$dir/$name"
  python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['max_position_embeddings']=40960; json.dump(c,open(p,'w'))" \
    "$dir/$name/config.json"
}

# The SmolLM-135M shape as DIR/smollm.
ensure_smollm() {
  ensure_random "$1" "$2" smollm-135m smollm
}
