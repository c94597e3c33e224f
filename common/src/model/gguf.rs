//! The metadata of a GGUF file (llama.cpp's format) without its tensors:
//! the header, the typed key/value metadata and the tensor descriptors,
//! enough to build the model's [`ModelConfig`] and the config hash that
//! identifies it. The coordinator reads this; the worker also reads the
//! tensors (with candle's parser) when it loads the weights.
//!
//! Follows ggml's `docs/gguf.md`: little-endian; magic `GGUF`; a `u32`
//! version; tensor and key/value counts; each key a string, then a `u32`
//! value type and the value (arrays: element type, length, elements); then
//! per tensor its name, `u32` dimension count, the dimensions (fastest
//! varying first), its GGML type and data offset. Strings, counts and
//! dimensions are `u64` from version 2 on and `u32` in version 1. Every
//! length read from the file is checked against the bytes left in it before
//! anything is allocated, so a hostile or truncated file is an error, never
//! a huge allocation or a panic. Array elements are skipped, not kept:
//! nothing here reads the vocabulary or the merges.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use super::{ModelError, Result};

mod info;
pub use info::{GgufInfo, info_from, read_info};

/// `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Longest string kept (keys, tensor names, values such as a chat template).
const MAX_STRING_BYTES: u64 = 64 << 20;
/// Deepest nesting of arrays inside arrays.
const MAX_ARRAY_DEPTH: usize = 16;
/// `GGML_TYPE_F32`.
const GGML_TYPE_F32: u32 = 0;

/// The type tag of a metadata value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufType {
    fn from_u32(tag: u32) -> std::result::Result<Self, String> {
        const TYPES: [GgufType; 13] = [
            GgufType::U8,
            GgufType::I8,
            GgufType::U16,
            GgufType::I16,
            GgufType::U32,
            GgufType::I32,
            GgufType::F32,
            GgufType::Bool,
            GgufType::String,
            GgufType::Array,
            GgufType::U64,
            GgufType::I64,
            GgufType::F64,
        ];
        usize::try_from(tag).ok().and_then(|i| TYPES.get(i).copied()).ok_or_else(|| format!("unknown value type {tag}"))
    }

    /// Bytes on disk of a fixed-size value; None for strings and arrays.
    fn fixed_size(self) -> Option<u64> {
        match self {
            Self::U8 | Self::I8 | Self::Bool => Some(1),
            Self::U16 | Self::I16 => Some(2),
            Self::U32 | Self::I32 | Self::F32 => Some(4),
            Self::U64 | Self::I64 | Self::F64 => Some(8),
            Self::String | Self::Array => None,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// An array's element type and length (the elements are skipped).
    Array {
        item: GgufType,
        len: u64,
    },
    /// An array of booleans, kept (llama.cpp's per-layer flags, such as
    /// which layers slide).
    Bools(Vec<bool>),
}

/// Where one tensor is and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// GGML order: the fastest-varying dimension first, so a `[rows, cols]`
    /// matrix in PyTorch terms is `[cols, rows]` here.
    pub dims: Vec<u64>,
    /// The GGML type id (0 = f32, 1 = f16, 8 = Q8_0, ...).
    pub ggml_type: u32,
    /// Offset of the data from the start of the (aligned) tensor data.
    pub offset: u64,
}

/// A GGUF file's header: everything before the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: HashMap<String, GgufValue>,
    pub tensors: HashMap<String, GgufTensorInfo>,
    /// Where the tensor data starts in the file: the header's end, rounded
    /// up to `general.alignment` (32 when absent).
    pub data_offset: u64,
}

impl GgufHeader {
    /// Reads the header of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::file(path, e.to_string()))?;
        Self::read(file).map_err(|e| ModelError::file(path, format!("not a GGUF file: {e}")))
    }

    /// Reads a header from the start of `source`.
    pub fn read<R: Read + Seek>(source: R) -> std::result::Result<Self, String> {
        let mut r = Reader::new(source).map_err(|e| e.to_string())?;
        let magic: [u8; 4] = r.bytes()?;
        if &magic != b"GGUF" {
            return Err(format!("bad magic {magic:02x?} (expected \"GGUF\")"));
        }
        let version = r.u32()?;
        r.wide = match version {
            1 => false,
            2 | 3 => true,
            other => return Err(format!("unsupported version {other}")),
        };
        let tensor_count = r.length()?;
        let kv_count = r.length()?;
        // Smallest possible entries: a key/value is a length, a type and
        // one byte; a tensor is a name length, no dimensions, type, offset.
        let prefix = r.length_size();
        let needed = kv_count.saturating_mul(prefix + 5).saturating_add(tensor_count.saturating_mul(prefix + 16));
        if needed > r.remaining() {
            return Err(format!(
                "{tensor_count} tensors and {kv_count} metadata entries cannot fit in the {} bytes left",
                r.remaining()
            ));
        }
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let ty = GgufType::from_u32(r.u32()?).map_err(|e| format!("{key}: {e}"))?;
            let value = r.value(ty).map_err(|e| format!("{key}: {e}"))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensor_count {
            let name = r.string()?;
            let rank = r.u32()?;
            if rank > MAX_DIMS {
                return Err(format!("tensor {name} has {rank} dimensions (at most {MAX_DIMS})"));
            }
            let dims = (0..rank).map(|_| r.length()).collect::<std::result::Result<_, _>>()?;
            let ggml_type = r.u32()?;
            let offset = r.u64()?;
            tensors.insert(name, GgufTensorInfo { dims, ggml_type, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(other) => return Err(format!("general.alignment {other:?} is not a power of two")),
        };
        let data_offset = r.pos.next_multiple_of(alignment);
        Ok(Self { version, metadata, tensors, data_offset })
    }
}

/// A bounded little-endian reader over the file.
struct Reader<R> {
    inner: BufReader<R>,
    pos: u64,
    size: u64,
    /// Lengths and counts are u64 (version 2 on) rather than u32.
    wide: bool,
}

impl<R: Read + Seek> Reader<R> {
    fn new(source: R) -> std::io::Result<Self> {
        let mut inner = BufReader::new(source);
        let size = inner.seek(SeekFrom::End(0))?;
        inner.seek(SeekFrom::Start(0))?;
        Ok(Self { inner, pos: 0, size, wide: true })
    }

    fn remaining(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }

    /// Fails unless `n` more bytes are in the file.
    fn ensure(&self, n: u64, what: &str) -> std::result::Result<(), String> {
        if n > self.remaining() {
            return Err(format!("{what} of {n} bytes at offset {} runs past the end of the file", self.pos));
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        self.ensure(N as u64, "a field")?;
        let mut buf = [0; N];
        self.inner.read_exact(&mut buf).map_err(|e| format!("offset {}: {e}", self.pos))?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn skip(&mut self, n: u64, what: &str) -> std::result::Result<(), String> {
        self.ensure(n, what)?;
        let step = i64::try_from(n).map_err(|_| format!("{what} of {n} bytes is too long"))?;
        self.inner.seek_relative(step).map_err(|e| format!("offset {}: {e}", self.pos))?;
        self.pos += n;
        Ok(())
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        self.bytes().map(u64::from_le_bytes)
    }

    fn length_size(&self) -> u64 {
        if self.wide { 8 } else { 4 }
    }

    /// A string length, element count or dimension.
    fn length(&mut self) -> std::result::Result<u64, String> {
        if self.wide { self.u64() } else { self.u32().map(u64::from) }
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.length()?;
        if len > MAX_STRING_BYTES {
            return Err(format!("a string of {len} bytes at offset {} (at most {MAX_STRING_BYTES})", self.pos));
        }
        self.ensure(len, "a string")?;
        let mut buf = vec![0; len as usize];
        self.inner.read_exact(&mut buf).map_err(|e| format!("offset {}: {e}", self.pos))?;
        self.pos += len;
        // Writers are known to leave NUL terminators, and some vocabularies
        // are not valid UTF-8; candle and llama.cpp accept both.
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn value(&mut self, ty: GgufType) -> std::result::Result<GgufValue, String> {
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(u8::from_le_bytes(self.bytes()?)),
            GgufType::I8 => GgufValue::I8(i8::from_le_bytes(self.bytes()?)),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.bytes()?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.bytes()?)),
            GgufType::U32 => GgufValue::U32(self.u32()?),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.bytes()?)),
            GgufType::U64 => GgufValue::U64(self.u64()?),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.bytes()?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.bytes()?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.bytes()?)),
            GgufType::Bool => match self.bytes::<1>()? {
                [0] => GgufValue::Bool(false),
                [1] => GgufValue::Bool(true),
                [b] => return Err(format!("bool value {b} is neither 0 nor 1")),
            },
            GgufType::String => GgufValue::String(self.string()?),
            GgufType::Array => self.array()?,
        })
    }

    /// An array: booleans kept, anything else skipped.
    fn array(&mut self) -> std::result::Result<GgufValue, String> {
        let item = GgufType::from_u32(self.u32()?)?;
        if item != GgufType::Bool {
            let len = self.skip_elements(item, 0)?;
            return Ok(GgufValue::Array { item, len });
        }
        let len = self.length()?;
        self.ensure(len, "an array")?;
        let bools = (0..len)
            .map(|_| match self.bytes::<1>()? {
                [0] => Ok(false),
                [1] => Ok(true),
                [b] => Err(format!("bool value {b} is neither 0 nor 1")),
            })
            .collect::<std::result::Result<_, String>>()?;
        Ok(GgufValue::Bools(bools))
    }

    /// Reads an array's element type and length and skips its elements.
    fn skip_array(&mut self, depth: usize) -> std::result::Result<(GgufType, u64), String> {
        let item = GgufType::from_u32(self.u32()?)?;
        Ok((item, self.skip_elements(item, depth)?))
    }

    /// Reads the length of an array of `item`s and skips its elements.
    fn skip_elements(&mut self, item: GgufType, depth: usize) -> std::result::Result<u64, String> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"));
        }
        let len = self.length()?;
        // The least each element takes: its bytes, or a length (strings),
        // or a type and a length (arrays).
        let least = item.fixed_size().unwrap_or(match item {
            GgufType::Array => 4 + self.length_size(),
            _ => self.length_size(),
        });
        self.ensure(len.saturating_mul(least), "an array")?;
        match item {
            GgufType::String => {
                for _ in 0..len {
                    let n = self.length()?;
                    self.skip(n, "a string")?;
                }
            }
            GgufType::Array => {
                for _ in 0..len {
                    self.skip_array(depth + 1)?;
                }
            }
            GgufType::Bool => {
                // Every element must still be a valid bool.
                for _ in 0..len {
                    self.value(GgufType::Bool)?;
                }
            }
            _ => self.skip(len * least, "an array")?,
        }
        Ok(len)
    }
}

#[cfg(test)]
mod tests {
    use super::info::{layer_types, rope_scaling};
    use super::*;
    use crate::model::config::Architecture;

    /// A little GGUF writer, just enough to build test files.
    #[derive(Default)]
    struct Writer {
        bytes: Vec<u8>,
        wide: bool,
    }

    impl Writer {
        fn new(version: u32, tensors: u64, kvs: u64) -> Self {
            let mut w = Self { bytes: b"GGUF".to_vec(), wide: version >= 2 };
            w.u32(version);
            w.len(tensors);
            w.len(kvs);
            w
        }
        fn u32(&mut self, v: u32) -> &mut Self {
            self.bytes.extend(v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.bytes.extend(v.to_le_bytes());
            self
        }
        fn len(&mut self, n: u64) -> &mut Self {
            if self.wide { self.u64(n) } else { self.u32(n as u32) }
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.len(s.len() as u64);
            self.bytes.extend(s.as_bytes());
            self
        }
        /// A key and a value's type tag; the value follows.
        fn key(&mut self, key: &str, ty: u32) -> &mut Self {
            self.str(key).u32(ty)
        }
        fn tensor(&mut self, name: &str, dims: &[u64], ggml_type: u32) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.len(d);
            }
            self.u32(ggml_type).u64(0)
        }
        fn read(&self) -> std::result::Result<GgufHeader, String> {
            GgufHeader::read(std::io::Cursor::new(&self.bytes))
        }
    }

    // Value type tags of the spec.
    const U8: u32 = 0;
    const I32: u32 = 5;
    const U32: u32 = 4;
    const F32: u32 = 6;
    const BOOL: u32 = 7;
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    const U64: u32 = 10;

    /// A Qwen3-shaped file: every metadata value the config reads, arrays
    /// (strings, nested) that must be skipped, a quantized matrix.
    fn qwen3_file() -> Writer {
        let mut w = Writer::new(3, 3, 14);
        w.key("general.architecture", STRING).str("qwen3\0");
        w.key("qwen3.embedding_length", U32).u32(64);
        w.key("qwen3.feed_forward_length", U64).u64(128);
        w.key("qwen3.block_count", I32).u32(2);
        w.key("qwen3.attention.head_count", U32).u32(4);
        w.key("qwen3.attention.head_count_kv", U8).bytes.push(2);
        w.key("qwen3.attention.key_length", U32).u32(32);
        w.key("qwen3.attention.layer_norm_rms_epsilon", F32).u32(1e-6f32.to_bits());
        w.key("qwen3.rope.freq_base", F32).u32(1_000_000f32.to_bits());
        w.key("qwen3.context_length", U32).u32(40960);
        w.key("tokenizer.ggml.tokens", ARRAY).u32(STRING).len(3).str("a").str("").str("<|im_end|>");
        w.key("nested", ARRAY).u32(ARRAY).len(2).u32(U32).len(1).u32(7).u32(BOOL).len(2);
        w.bytes.extend([1, 0]);
        w.key("tokenizer.ggml.bos_token_id", U32).u32(1);
        w.key("tokenizer.ggml.eos_token_id", U32).u32(3);
        w.tensor("token_embd.weight", &[64, 1000], 1);
        w.tensor("blk.0.attn_q.weight", &[64, 128], 8);
        w.tensor("output_norm.weight", &[64], GGML_TYPE_F32);
        w
    }

    /// llama.cpp's rules for which layers slide: a flag per layer, or a
    /// count `n` (every `n`-th layer full; 0: all slide), or the family's
    /// default count.
    #[test]
    fn sliding_layers_follow_llama_cpp_s_pattern_rules() {
        let full = |v: serde_json::Value| -> Vec<bool> {
            v.as_array().unwrap().iter().map(|t| t == "full_attention").collect()
        };
        let count = |n: Option<u64>| {
            move |key: &str| -> Result<u64> {
                match (key, n) {
                    ("attention.sliding_window_pattern", Some(n)) => Ok(n),
                    _ => Err(ModelError::InvalidConfig(format!("{key} is missing"))),
                }
            }
        };
        let none = HashMap::new();
        let default = layer_types(&none, "gemma3", 7, 6, &count(None)).unwrap();
        assert_eq!(full(default), [false, false, false, false, false, true, false]);
        assert_eq!(full(layer_types(&none, "gemma3", 4, 6, &count(Some(3))).unwrap()), [false, false, true, false]);
        assert_eq!(full(layer_types(&none, "gemma3", 3, 6, &count(Some(0))).unwrap()), [false, false, false]);
        let flags = HashMap::from([(
            "gpt-oss.attention.sliding_window_pattern".to_string(),
            GgufValue::Bools(vec![true, false, false]),
        )]);
        assert_eq!(full(layer_types(&flags, "gpt-oss", 3, 2, &count(None)).unwrap()), [false, true, true]);
        assert!(layer_types(&flags, "gpt-oss", 4, 2, &count(None)).unwrap_err().contains("3 layers of 4"));
    }

    /// `{arch}.rope.scaling.*` as `config.json`'s `rope_scaling`.
    #[test]
    fn rope_scaling_reads_as_config_json_spells_it() {
        let md = |pairs: &[(&str, GgufValue)]| -> HashMap<String, GgufValue> {
            pairs.iter().map(|(k, v)| (format!("a.rope.scaling.{k}"), v.clone())).collect()
        };
        let yarn = md(&[
            ("type", GgufValue::String("yarn".into())),
            ("factor", GgufValue::F32(32.0)),
            ("original_context_length", GgufValue::U32(4096)),
            ("yarn_beta_fast", GgufValue::F32(32.0)),
        ]);
        let gpt_oss = rope_scaling(&yarn, "a", Architecture::GptOss).unwrap().unwrap();
        assert_eq!(
            gpt_oss,
            serde_json::json!({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "truncate": false})
        );
        let qwen3 = rope_scaling(&yarn, "a", Architecture::Qwen3).unwrap().unwrap();
        assert_eq!(qwen3.get("truncate"), None);
        let linear = md(&[("type", GgufValue::String("linear".into())), ("factor", GgufValue::F32(8.0))]);
        assert_eq!(
            rope_scaling(&linear, "a", Architecture::Gemma3).unwrap(),
            Some(serde_json::json!({"rope_type": "linear", "factor": 8.0}))
        );
        assert_eq!(
            rope_scaling(&md(&[("type", GgufValue::String("none".into()))]), "a", Architecture::Llama),
            Ok(None)
        );
        let long = md(&[("type", GgufValue::String("longrope".into())), ("factor", GgufValue::F32(4.0))]);
        assert!(rope_scaling(&long, "a", Architecture::Llama).unwrap_err().contains("longrope"));
        let no_context = md(&[("type", GgufValue::String("yarn".into())), ("factor", GgufValue::F32(4.0))]);
        assert!(rope_scaling(&no_context, "a", Architecture::Qwen3).unwrap_err().contains("original_context_length"));
    }

    #[test]
    fn reads_header_metadata_and_tensors() {
        let header = qwen3_file().read().unwrap();
        assert_eq!(header.version, 3);
        assert_eq!(header.metadata["general.architecture"], GgufValue::String("qwen3".into()));
        assert_eq!(header.metadata["qwen3.attention.head_count_kv"], GgufValue::U8(2));
        assert_eq!(header.metadata["tokenizer.ggml.tokens"], GgufValue::Array { item: GgufType::String, len: 3 });
        assert_eq!(header.metadata["nested"], GgufValue::Array { item: GgufType::Array, len: 2 });
        assert_eq!(header.metadata["tokenizer.ggml.eos_token_id"], GgufValue::U32(3));
        let q = &header.tensors["blk.0.attn_q.weight"];
        assert_eq!((q.dims.as_slice(), q.ggml_type), ([64, 128].as_slice(), 8));
        assert_eq!(header.tensors.len(), 3);
    }

    #[test]
    fn the_config_json_is_pinned() {
        // The config hash of a GGUF model is the hash of this text: any
        // change here makes workers and coordinators of different builds
        // refuse each other.
        let info = info_from(&qwen3_file().read().unwrap(), Path::new("x.gguf")).unwrap();
        assert_eq!(
            info.config_json,
            r#"{"architectures":["Qwen3ForCausalLM"],"head_dim":32,"hidden_act":"silu","hidden_size":64,"intermediate_size":128,"max_position_embeddings":40960,"num_attention_heads":4,"num_hidden_layers":2,"num_key_value_heads":2,"rms_norm_eps":9.999999974752427e-7,"rope_theta":1000000.0,"tie_word_embeddings":true,"torch_dtype":"float16","vocab_size":1000}"#
        );
        let cfg = &info.config;
        assert_eq!((cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), (Architecture::Qwen3, 2, 2, 32));
        assert!(cfg.qk_norm && cfg.tie_word_embeddings);
        assert_eq!((info.bos_token_id, info.eos_token_ids.as_slice()), (Some(1), [3].as_slice()));
    }

    #[test]
    fn missing_or_unsupported_metadata_is_named() {
        let mut w = Writer::new(2, 1, 1);
        w.key("general.architecture", STRING).str("gpt2");
        w.tensor("token_embd.weight", &[8, 16], 0);
        let err = info_from(&w.read().unwrap(), Path::new("m.gguf")).unwrap_err().to_string();
        assert!(err.contains("m.gguf") && err.contains("\"gpt2\" is not supported"), "{err}");
        let mut w = Writer::new(2, 1, 1);
        w.key("general.architecture", STRING).str("llama");
        w.tensor("token_embd.weight", &[8, 16], 0);
        let err = info_from(&w.read().unwrap(), Path::new("m.gguf")).unwrap_err().to_string();
        assert!(err.contains("metadata llama.attention.head_count is missing"), "{err}");
    }

    #[test]
    fn version_1_has_32_bit_lengths() {
        let mut w = Writer::new(1, 1, 1);
        w.key("general.architecture", STRING).str("llama");
        w.tensor("token_embd.weight", &[8, 16], 0);
        let header = w.read().unwrap();
        assert_eq!((header.version, header.tensors["token_embd.weight"].dims.as_slice()), (1, [8, 16].as_slice()));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let whole = qwen3_file().bytes;
        for end in 0..whole.len() {
            let cut = std::io::Cursor::new(&whole[..end]);
            assert!(GgufHeader::read(cut).is_err(), "cut at {end}");
        }
    }

    #[test]
    fn hostile_lengths_are_errors_not_allocations() {
        let fail = |w: &Writer, want: &str| {
            let err = w.read().unwrap_err();
            assert!(err.contains(want), "{err} (wanted {want:?})");
        };
        fail(&Writer::new(3, u64::MAX, u64::MAX), "cannot fit");
        fail(&Writer::new(3, 0, 1 << 40), "cannot fit");
        let mut w = Writer::new(3, 0, 1);
        w.len(u64::MAX).bytes.extend([0; 16]);
        fail(&w, "at most");
        let mut w = Writer::new(3, 0, 1);
        w.len(1 << 20).bytes.extend([0; 16]);
        fail(&w, "past the end");
        let mut w = Writer::new(3, 0, 1);
        w.key("k", ARRAY).u32(U64).len(u64::MAX / 4);
        fail(&w, "past the end");
        let mut w = Writer::new(3, 0, 1);
        w.key("k", ARRAY).u32(STRING).len(2).len(u64::MAX).len(0);
        fail(&w, "past the end");
        let mut w = Writer::new(3, 0, 1);
        w.key("k", ARRAY);
        for _ in 0..40 {
            w.u32(ARRAY).len(1);
        }
        w.u32(U8).len(0);
        fail(&w, "nested deeper");
        let mut w = Writer::new(3, 1, 0);
        w.tensor("t", &[1, 1, 1, 1, 1], 0);
        fail(&w, "5 dimensions");
    }

    #[test]
    fn malformed_values_are_errors() {
        let fail = |w: &Writer, want: &str| {
            let err = w.read().unwrap_err();
            assert!(err.contains(want), "{err} (wanted {want:?})");
        };
        fail(&Writer { bytes: b"GGML\x03\0\0\0".to_vec(), wide: true }, "bad magic");
        fail(&Writer::new(4, 0, 0), "unsupported version 4");
        let mut w = Writer::new(3, 0, 1);
        w.key("k", 13).u32(0);
        fail(&w, "k: unknown value type 13");
        let mut w = Writer::new(3, 0, 1);
        w.key("k", BOOL).bytes.extend([2, 0, 0, 0, 0]);
        fail(&w, "neither 0 nor 1");
        let err = GgufHeader::open(Path::new("/nonexistent/x.gguf")).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/x.gguf"), "{err}");
    }
}
