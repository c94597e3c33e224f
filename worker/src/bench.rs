//! Offline throughput benchmark in the style of vLLM's
//! `benchmark_throughput`: N prompts of random tokens with fixed input and
//! output lengths (`ignore_eos`), all submitted at once, run to completion.
//! The `Copy` workload gives outputs that repeat a span of their prompt,
//! for n-gram speculative decoding.
//! With a structured-output constraint, each request instead runs until its
//! grammar is complete (or `output_len`), and its time per output token
//! counts the tokens it made.

use std::time::{Duration, Instant};

use common::{RequestId, SamplingParams, StructuredOutput};

use crate::Engine;
use crate::error::Result;
use crate::profile::{StepProfile, Totals};

#[derive(Clone, Debug)]
pub struct BenchArgs {
    pub num_prompts: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub seed: u64,
    /// Time the parts of each pure decode step (`bench --profile`).
    pub profile: bool,
    /// Score every prompt too (`prompt_logprobs` with this many top tokens),
    /// as an evaluation harness does.
    pub prompt_logprobs: Option<u32>,
    pub workload: Workload,
    /// Constrain every output (structured outputs).
    pub structured_output: Option<StructuredOutput>,
}

/// What the prompts hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Workload {
    /// Random tokens: outputs share nothing with their prompt.
    #[default]
    Random,
    /// Outputs that repeat a span of the prompt, as when editing or
    /// summarising a given text (n-gram speculation's case): each prompt is
    /// `P C P`, where P is random and C is the model's own greedy
    /// continuation of P (made before the timed run). A model that
    /// continues the second P as it did the first copies C from its prompt.
    /// `input_len` is the length of P.
    Copy,
    /// Each prompt is `P C`, where C is the model's own greedy continuation
    /// of P, `n` tokens long (made before the timed run): the timed run
    /// continues its own text, token for token as it would have gone on.
    /// Long greedy outputs repeat themselves, so a long enough C makes the
    /// output repeat spans of the prompt (a random-weights model falls into
    /// loops after a few hundred tokens; a trained one repeats names, lines
    /// and phrases). `input_len` is the length of P.
    Continue(usize),
}

/// mean / p50 / p99 of a latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Summary {
    fn of(mut values: Vec<Duration>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let pct = |p: f64| ms(values[((values.len() - 1) as f64 * p).round() as usize]);
        Self {
            mean_ms: values.iter().map(|&d| ms(d)).sum::<f64>() / values.len() as f64,
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
        }
    }
}

#[derive(Clone, Debug)]
pub struct BenchReport {
    pub args: BenchArgs,
    pub elapsed: Duration,
    pub requests_per_s: f64,
    /// Tokens generated in all.
    pub output_tokens: usize,
    pub output_tok_per_s: f64,
    pub total_tok_per_s: f64,
    pub ttft: Summary,
    /// Time per output token after the first, per request.
    pub tpot: Summary,
    pub peak_kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// How the KV cache stored values (`--kv-cache-dtype`).
    pub kv_cache_dtype: kernels::KvCacheDtype,
    pub steps: usize,
    /// Proposals made and accepted during the timed run.
    pub spec_decoding: engine_core::SpecDecodingStats,
    /// Set with `BenchArgs::profile`.
    pub profile: Option<StepProfile>,
    /// Set with `BenchArgs::profile` on a step plan that counts device
    /// memory (`--device metal-emulated`): a batch-1 decode step's traffic.
    pub traffic: Option<crate::runner::plan::Traffic>,
    /// Set with `BenchArgs::profile` on the CPU: how close batch-1 decode
    /// comes to what memory bandwidth allows.
    pub bandwidth: Option<BandwidthLimit>,
    /// Set with `BenchArgs::profile` on the CPU: batch-1 decode steps, each
    /// beside probe passes taken right before and after it.
    pub paired: Option<PairedShares>,
}

/// Batch-1 decode steps each compared with probe passes taken right before
/// and right after it (after the timed run, one request of the same
/// lengths): a shared host's bandwidth moves with its neighbours within
/// seconds, so a probe before and after the whole run can miss the phase a
/// step ran in, in either direction.
///
/// Beside them, the probe itself in a step's place: after every other
/// step, a read of the weights' bytes by the probe, timed and compared in
/// the same way. Its share is the most this measure can show where the
/// bandwidth moves between a step and the passes beside it (a step can
/// only be compared with the better pass, and neither pass is the step).
#[derive(Clone, Debug, Default)]
pub struct PairedShares {
    pub steps: Vec<PairedStep>,
    /// The probe's reads in a step's place (`round_trip_ns` unmeasured).
    pub reads: Vec<PairedStep>,
}

/// One pure decode step of [`PairedShares`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairedStep {
    /// The step's weight bytes per second over the better of its passes.
    pub share: f64,
    /// That pass, in GB/s.
    pub pass_gb_s: f64,
    /// A cache line's round trip between two of the pool's threads, taken
    /// right after the step (where the vCPUs sat; `None` with one thread).
    pub round_trip_ns: Option<f64>,
    /// Whether the kernels took the pool's threads to be on two core
    /// complexes after the step ([`kernels::cpu::placement`], which checks
    /// every few steps).
    pub kernels_far: bool,
}

/// What one paired pass reads: several times the last-level cache, and
/// short (a few ms) next to a step.
const PAIRED_PROBE_BYTES: usize = 512 << 20;

/// Round trips per step: tens of microseconds.
const PAIRED_ROUND_TRIPS: usize = 200;

impl PairedShares {
    /// The median share among steps whose pass reached at least `floor` of
    /// the best pass, and how many such steps there were.
    pub fn median_share_above(&self, floor: f64) -> (f64, usize) {
        median_share(self.above(&self.steps, floor, true))
    }

    /// The median round trip among the steps whose pass reached `floor` of
    /// the best (`above`) or did not, where it was measured.
    pub fn median_round_trip_ns(&self, floor: f64, above: bool) -> Option<f64> {
        let trips: Vec<f64> = self.steps_above(floor, above).filter_map(|s| s.round_trip_ns).collect();
        (!trips.is_empty()).then(|| median(trips))
    }

    /// How many of the steps whose pass reached `floor` of the best
    /// (`above`) or did not the kernels ran as on two core complexes, and
    /// how many steps that side has.
    pub fn kernels_far_above(&self, floor: f64, above: bool) -> (usize, usize) {
        self.steps_above(floor, above).fold((0, 0), |(far, n), s| (far + usize::from(s.kernels_far), n + 1))
    }

    /// [`Self::median_share_above`] for the probe's reads in a step's
    /// place, with the floor taken from the steps' best pass.
    pub fn median_read_share_above(&self, floor: f64) -> (f64, usize) {
        median_share(self.above(&self.reads, floor, true))
    }

    fn steps_above(&self, floor: f64, above: bool) -> impl Iterator<Item = &PairedStep> {
        self.above(&self.steps, floor, above)
    }

    /// The entries of `of` whose pass reached `floor` of the steps' best
    /// pass (`above`) or did not.
    fn above<'a>(&self, of: &'a [PairedStep], floor: f64, above: bool) -> impl Iterator<Item = &'a PairedStep> {
        let cut = floor * self.steps.iter().map(|s| s.pass_gb_s).fold(0.0, f64::max);
        of.iter().filter(move |s| (s.pass_gb_s >= cut) == above)
    }
}

/// The median share of `steps`, and how many there were.
fn median_share<'a>(steps: impl Iterator<Item = &'a PairedStep>) -> (f64, usize) {
    let shares: Vec<f64> = steps.map(|s| s.share).collect();
    let count = shares.len();
    (median(shares), count)
}

/// The upper median (0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Batch-1 decode reads every weight once per token, so the machine's read
/// bandwidth bounds it at `limit / weight_bytes` tokens per second.
///
/// The limit is probed just before and just after the run (wide loads, all
/// threads of the pool; [`kernels::cpu::bandwidth`]) and the better of the
/// two is taken: on a shared machine the bandwidth drifts by tens of percent
/// within minutes, and only a probe that reaches the hardware's best makes
/// the share an honest one.
#[derive(Clone, Copy, Debug)]
pub struct BandwidthLimit {
    pub before: kernels::cpu::ReadBandwidth,
    pub after: kernels::cpu::ReadBandwidth,
    pub weight_bytes: usize,
}

impl BandwidthLimit {
    pub fn read_gb_s(&self) -> f64 {
        self.before.limit_gb_s.max(self.after.limit_gb_s)
    }

    pub fn tok_per_s(&self) -> f64 {
        self.read_gb_s() * 1e9 / self.weight_bytes.max(1) as f64
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = &self.args;
        writeln!(
            f,
            "prompts {} x (input {} + output {}){}{}, {} steps in {:.2} s",
            a.num_prompts,
            a.input_len,
            a.output_len,
            a.prompt_logprobs.map_or(String::new(), |n| format!(", prompts scored (prompt_logprobs {n})")),
            a.structured_output
                .as_ref()
                .map_or(String::new(), |_| format!(", outputs constrained ({} tokens made)", self.output_tokens)),
            self.steps,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(
            f,
            "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            self.requests_per_s, self.output_tok_per_s, self.total_tok_per_s
        )?;
        writeln!(
            f,
            "TTFT ms:  mean {:.1}  p50 {:.1}  p99 {:.1}",
            self.ttft.mean_ms, self.ttft.p50_ms, self.ttft.p99_ms
        )?;
        if a.output_len > 1 {
            writeln!(
                f,
                "TPOT ms:  mean {:.2}  p50 {:.2}  p99 {:.2}  (decode {:.1} tok/s per request)",
                self.tpot.mean_ms,
                self.tpot.p50_ms,
                self.tpot.p99_ms,
                1e3 / self.tpot.mean_ms.max(1e-9)
            )?;
        } else {
            // One output token: nothing is decoded after the first.
            writeln!(f, "TPOT: none (one output token a request)")?;
        }
        let spec = &self.spec_decoding;
        if spec.num_drafts > 0 {
            writeln!(
                f,
                "speculative: {} proposals of {} tokens, {} accepted ({:.1}%), {:.2} tokens per request-step",
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                spec.acceptance_rate() * 100.0,
                1.0 + spec.num_accepted_tokens as f64 / spec.num_drafts as f64
            )?;
        }
        write!(
            f,
            "KV blocks ({}): peak {} used of {}",
            self.kv_cache_dtype, self.peak_kv_blocks_used, self.kv_blocks_total
        )?;
        if let Some(b) = &self.bandwidth {
            let decode = 1e3 / self.tpot.mean_ms.max(1e-9);
            write!(
                f,
                "\nbandwidth limit: {:.3} GB of weights per decode step at {:.1} GB/s read (best pass of the \
                 probes before and after the run; medians {:.1} and {:.1}) = {:.2} tok/s at batch 1; this run \
                 decodes at {:.1}% of it",
                b.weight_bytes as f64 / 1e9,
                b.read_gb_s(),
                b.before.median_gb_s,
                b.after.median_gb_s,
                b.tok_per_s(),
                decode / b.tok_per_s() * 100.0
            )?;
        }
        if let Some(p) = self.paired.as_ref().filter(|p| !p.steps.is_empty()) {
            let (lo, hi) =
                p.steps.iter().fold((f64::MAX, 0f64), |(lo, hi), s| (lo.min(s.pass_gb_s), hi.max(s.pass_gb_s)));
            let (all, n) = p.median_share_above(0.0);
            let (fast, nf) = p.median_share_above(0.8);
            write!(
                f,
                "\npaired probe: {n} batch-1 decode steps, each beside {} MiB passes read right before and after \
                 it ({lo:.1}-{hi:.1} GB/s): median {:.1}% of the better pass; {:.1}% over the {nf} steps whose \
                 pass reached 80% of the best",
                PAIRED_PROBE_BYTES >> 20,
                all * 100.0,
                fast * 100.0
            )?;
            let ((read_all, nr), (read_fast, nrf)) = (p.median_read_share_above(0.0), p.median_read_share_above(0.8));
            write!(
                f,
                "\nthe probe in a step's place (after every other step, the weights' bytes read and compared the \
                 same way): median {:.1}% over {nr} reads, {:.1}% over the {nrf} whose pass reached 80% of the \
                 steps' best: the most this measure shows here",
                read_all * 100.0,
                read_fast * 100.0
            )?;
            let trip = |above| p.median_round_trip_ns(0.8, above).map_or("-".to_string(), |ns| format!("{ns:.0} ns"));
            write!(
                f,
                "\ncross-core round trip (median, right after each step): {} over those steps, {} over the others",
                trip(true),
                trip(false)
            )?;
            let ((far, n), (far_rest, n_rest)) = (p.kernels_far_above(0.8, true), p.kernels_far_above(0.8, false));
            write!(
                f,
                "\nkernels' placement (checked every {} steps; across core complexes, decode's Q8_0 matmuls flush \
                 their input): two complexes after {far} of those {n} steps, {far_rest} of the other {n_rest}",
                kernels::cpu::placement::REFRESH_STEPS
            )?;
        }
        if let Some(p) = &self.profile {
            write!(f, "\n{p}")?;
        }
        if let Some(t) = &self.traffic {
            write!(
                f,
                "\nGPU memory traffic of a batch-1 decode step: {} bytes touched / {} bytes of weights and KV it \
                 must read = {:.2}x",
                t.touched,
                t.must_read,
                t.ratio()
            )?;
        }
        Ok(())
    }
}

/// The device-memory traffic of one batch-1 decode step after a prompt of
/// the run's input length, on a step plan that counts it.
fn decode_traffic(engine: &mut Engine, args: &BenchArgs) -> Result<Option<crate::runner::plan::Traffic>> {
    let vocab = engine.model_config().vocab_size as u64;
    let mut state = args.seed ^ 0x7472_6166;
    let prompt = random_prompt(&mut state, args.input_len, vocab);
    let id = RequestId(u64::MAX);
    engine.add_request(id, prompt, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(2) }, 0)?;
    // The prefill (in chunks) until the first token, then the decode step.
    let mut decoding = false;
    let mut traffic = None;
    while engine.has_unfinished() {
        if decoding {
            engine.count_plan_traffic(true);
        }
        let outputs = engine.step()?;
        if decoding {
            traffic = engine.last_plan_traffic();
            engine.count_plan_traffic(false);
            engine.abort(id);
            break;
        }
        decoding = outputs.iter().any(|o| o.id == id && !o.new_token_ids.is_empty());
    }
    Ok(traffic)
}

/// Runs the benchmark on `engine`, which should be idle.
pub fn run(engine: &mut Engine, args: &BenchArgs) -> Result<BenchReport> {
    let vocab = engine.model_config().vocab_size as u64;
    // The CPU's bandwidth limit means nothing to a step plan (a GPU's, or
    // the emulator's).
    let on_cpu = engine.device().is_cpu() && !engine.runs_plan();
    let read_before = (args.profile && on_cpu).then(kernels::cpu::measure_read_bandwidth);
    let mut state = args.seed;
    // Random ids from 3 upwards (skip the usual unk/bos/eos ids).
    let mut prompts: Vec<Vec<u32>> =
        (0..args.num_prompts).map(|_| random_prompt(&mut state, args.input_len, vocab)).collect();
    match args.workload {
        Workload::Random => {}
        Workload::Copy => {
            let continued = own_continuations(engine, &prompts, args.output_len)?;
            prompts = prompts.into_iter().zip(continued).map(|(p, c)| [&p[..], &c, &p].concat()).collect();
        }
        Workload::Continue(n) => {
            let continued = own_continuations(engine, &prompts, n)?;
            prompts = prompts.into_iter().zip(continued).map(|(p, c)| [p, c].concat()).collect();
        }
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let spec_before = engine.stats().spec_decoding;
    let start = Instant::now();
    let mut first_token = vec![None; args.num_prompts];
    let mut last_token = vec![start; args.num_prompts];
    let mut made = vec![0usize; args.num_prompts];
    for (i, prompt) in prompts.into_iter().enumerate() {
        let params = SamplingParams {
            // A constrained output ends with its grammar.
            ignore_eos: args.structured_output.is_none(),
            prompt_logprobs: args.prompt_logprobs,
            structured_output: args.structured_output.clone(),
            ..SamplingParams::greedy(args.output_len as u32)
        };
        engine.add_request(RequestId(i as u64), prompt, params, 0)?;
    }
    let mut steps = 0;
    let mut peak = 0;
    crate::profile::set_enabled(args.profile);
    let mut profile = StepProfile::default();
    while engine.has_unfinished() {
        let (before, t0) = (Totals::now(), Instant::now());
        let outputs = engine.step()?;
        if args.profile {
            let info = engine.last_step();
            // Pure decode steps only: one new token per scheduled request.
            if info.num_batched_tokens == info.scheduled.len() {
                profile.steps += 1;
                profile.wall += t0.elapsed();
                profile.totals.add(&Totals::now().since(&before));
            }
        }
        steps += 1;
        let now = Instant::now();
        peak = peak.max(engine.stats().kv_blocks_used);
        for out in outputs.iter().filter(|o| !o.new_token_ids.is_empty()) {
            let i = out.id.0 as usize;
            first_token[i].get_or_insert(now);
            last_token[i] = now;
            made[i] += out.new_token_ids.len();
        }
    }
    let elapsed = start.elapsed();
    let bandwidth = read_before.map(|before| BandwidthLimit {
        before,
        after: kernels::cpu::measure_read_bandwidth(),
        weight_bytes: engine.weight_bytes_per_token(),
    });
    let paired = match &bandwidth {
        Some(b) => Some(paired_shares(engine, args, b.weight_bytes)?),
        None => None,
    };
    let traffic = if args.profile && engine.count_plan_traffic(false) { decode_traffic(engine, args)? } else { None };
    let ttft: Vec<Duration> = first_token.iter().map(|t| t.map_or(elapsed, |t| t - start)).collect();
    let tpot: Vec<Duration> = (0..args.num_prompts)
        .filter(|&i| made[i] > 1)
        .map(|i| (last_token[i] - first_token[i].unwrap_or(start)) / (made[i] as u32 - 1))
        .collect();
    let spec_after = engine.stats().spec_decoding;
    let spec_decoding = spec_after.since(&spec_before);
    let secs = elapsed.as_secs_f64();
    let output_tokens: usize = made.iter().sum();
    let out_tokens = output_tokens as f64;
    Ok(BenchReport {
        args: args.clone(),
        elapsed,
        requests_per_s: args.num_prompts as f64 / secs,
        output_tokens,
        output_tok_per_s: out_tokens / secs,
        total_tok_per_s: (prompt_tokens + output_tokens) as f64 / secs,
        ttft: Summary::of(ttft),
        tpot: Summary::of(tpot),
        peak_kv_blocks_used: peak,
        kv_blocks_total: engine.stats().kv_blocks_total,
        kv_cache_dtype: engine.kv_cache_dtype(),
        steps,
        spec_decoding,
        profile: args.profile.then_some(profile),
        traffic,
        bandwidth,
        paired,
    })
}

/// One request of the run's lengths, untimed but for its pure decode
/// steps, each between two probe passes.
fn paired_shares(engine: &mut Engine, args: &BenchArgs, weight_bytes: usize) -> Result<PairedShares> {
    use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};
    let probe = ProbeBuffer::new(PAIRED_PROBE_BYTES);
    let vocab = engine.model_config().vocab_size as u64;
    let mut state = args.seed ^ 0x5eed;
    let prompt = random_prompt(&mut state, args.input_len.max(1), vocab);
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(args.output_len as u32) };
    engine.add_request(RequestId(1 << 41), prompt, params, 0)?;
    let mut paired = PairedShares::default();
    // The better of the pass before what was just timed and a fresh one
    // after it, which is the next one's pass before.
    let mut pass_before = probe.pass(ReadProbe::Wide);
    let mut better_pass = || {
        let pass_after = probe.pass(ReadProbe::Wide);
        std::mem::replace(&mut pass_before, pass_after).max(pass_after)
    };
    while engine.has_unfinished() {
        let t0 = Instant::now();
        engine.step()?;
        let secs = t0.elapsed().as_secs_f64();
        let info = engine.last_step();
        let decode = info.scheduled.len() == 1 && info.num_batched_tokens == 1;
        let round_trip_ns =
            decode.then(|| kernels::cpu::bandwidth::cross_core_round_trip_ns(PAIRED_ROUND_TRIPS)).flatten();
        let pass = better_pass();
        if !decode {
            continue;
        }
        paired.steps.push(PairedStep {
            share: weight_bytes as f64 / secs / 1e9 / pass,
            pass_gb_s: pass,
            round_trip_ns,
            kernels_far: kernels::cpu::placement::threads_far_apart(),
        });
        if paired.steps.len() % 2 == 0 {
            let read = probe.read_gb_s(ReadProbe::Wide, weight_bytes);
            let pass = better_pass();
            paired.reads.push(PairedStep {
                share: read / pass,
                pass_gb_s: pass,
                round_trip_ns: None,
                kernels_far: false,
            });
        }
    }
    Ok(paired)
}

/// `P C P` for each random P, C being the model's greedy continuation of
/// P (`output_len` tokens), all computed in one untimed batch.
/// Each prompt's greedy continuation of `len` tokens (without speculation).
fn own_continuations(engine: &mut Engine, prompts: &[Vec<u32>], len: usize) -> Result<Vec<Vec<u32>>> {
    let first = 1 << 40; // ids apart from the timed run's
    for (i, p) in prompts.iter().enumerate() {
        let params = SamplingParams {
            ignore_eos: true,
            speculative: Some(common::Speculative::Off),
            ..SamplingParams::greedy(len as u32)
        };
        engine.add_request(RequestId(first + i as u64), p.clone(), params, 0)?;
    }
    let mut continuations = vec![Vec::new(); prompts.len()];
    while engine.has_unfinished() {
        for out in engine.step()? {
            continuations[(out.id.0 - first) as usize].extend(out.new_token_ids);
        }
    }
    Ok(continuations)
}

/// `len` random token ids past the first 3 (special tokens in most
/// vocabularies) of `vocab`.
fn random_prompt(state: &mut u64, len: usize, vocab: u64) -> Vec<u32> {
    (0..len).map(|_| (3 + splitmix(state) % (vocab - 3)) as u32).collect()
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::{PairedShares, PairedStep};

    #[test]
    fn paired_shares_pick_the_steps_of_fast_passes() {
        let step = |share, pass_gb_s, round_trip_ns: Option<f64>| PairedStep {
            share,
            pass_gb_s,
            round_trip_ns,
            kernels_far: round_trip_ns.is_some_and(|ns| ns >= 300.0),
        };
        let p = PairedShares {
            steps: vec![
                step(0.95, 30.0, Some(100.0)),
                step(0.80, 60.0, Some(400.0)),
                step(0.90, 58.0, None),
                step(0.70, 50.0, Some(420.0)),
            ],
            reads: vec![step(0.99, 31.0, None), step(0.97, 59.0, None), step(0.95, 55.0, None)],
        };
        assert_eq!(p.median_share_above(0.0), (0.90, 4));
        // 80% of the best pass (60) is 48: the last three steps.
        assert_eq!(p.median_share_above(0.8), (0.80, 3));
        assert_eq!(PairedShares::default().median_share_above(0.8), (0.0, 0));
        // Round trips where measured, on either side of the floor.
        assert_eq!(p.median_round_trip_ns(0.8, true), Some(420.0));
        assert_eq!(p.median_round_trip_ns(0.8, false), Some(100.0));
        assert_eq!(PairedShares::default().median_round_trip_ns(0.8, true), None);
        // The kernels' placement, counted on each side.
        assert_eq!(p.kernels_far_above(0.8, true), (2, 3));
        assert_eq!(p.kernels_far_above(0.8, false), (0, 1));
        assert_eq!(PairedShares::default().kernels_far_above(0.8, true), (0, 0));
        // The probe's own reads, above the floor of the steps' best pass.
        assert_eq!(p.median_read_share_above(0.0), (0.97, 3));
        assert_eq!(p.median_read_share_above(0.8), (0.97, 2));
        assert_eq!(PairedShares::default().median_read_share_above(0.8), (0.0, 0));
    }
}
