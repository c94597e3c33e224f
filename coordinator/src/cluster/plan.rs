//! Which offering workers (`--layers auto`) form a replica or a pipeline,
//! and which layers each holds (issue 30). Pure planning on plain
//! integers; `offers` runs it whenever an offer comes or goes.
//!
//! The rule (exo likewise weights each device's share of the layers by its
//! memory; vLLM splits evenly unless told a partition):
//!
//! * a stage's weights may take at most [`WEIGHT_SHARE`] of the memory it
//!   offers; the rest is for its KV cache (a worker's default KV budget is
//!   a quarter of its memory);
//! * without `--pipeline-parallel-size`, the first offer whose memory
//!   holds the whole model becomes a replica; otherwise the fewest offers
//!   that hold it together (largest first) form a pipeline;
//! * with `--pipeline-parallel-size N`, the N largest offers form a
//!   pipeline if they hold the model together;
//! * a pipeline's stages keep the order the offers came in, and its layers
//!   are split so that each stage's share of the layers' weights follows
//!   its memory (`common::pipeline::split_layers_by_weight`: a count of
//!   layers where they weigh the same).

use common::pipeline::{LayerRange, split_layers_by_weight};

/// The part of a stage's memory its weights may take: 3/4.
pub const WEIGHT_SHARE: (u64, u64) = (3, 4);

/// What the planner needs of one offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OfferedMemory {
    /// Bytes the worker can give the model (weights and KV cache).
    pub memory: u64,
    /// Bytes the whole model's weights take at the worker's dtype.
    pub model_weight_bytes: u64,
}

/// What to do with the offers (indices into the slice planned over).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// This offer holds every layer: a replica.
    Replica(usize),
    /// These offers, in stage order, each with its layers.
    Pipeline(Vec<(usize, LayerRange)>),
    /// Nothing can be formed yet.
    Wait(Shortfall),
}

/// Why nothing can be formed, in numbers (its `Display` is what `/health`
/// and the log say).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shortfall {
    NoOffers,
    /// `--pipeline-parallel-size` asks for more workers than offered.
    Workers {
        needed: usize,
        offered: usize,
    },
    /// The offers' memory together does not hold the weights.
    Memory {
        weight_bytes: u64,
        needed: u64,
        offered: u64,
        offers: usize,
    },
    /// More stages would be needed than the model has layers.
    Layers {
        layers: usize,
        stages: usize,
    },
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoOffers => write!(f, "no worker has offered itself"),
            Self::Workers { needed, offered } => write!(
                f,
                "--pipeline-parallel-size {needed} needs {needed} workers; {offered} {} offered",
                if *offered == 1 { "has" } else { "have" }
            ),
            Self::Memory { weight_bytes, needed, offered, offers } => write!(
                f,
                "the model needs {} of memory ({} of weights, at most {}/{} of each worker's memory, the rest for \
                 its KV cache); {offers} {} {} in total",
                bytes(*needed),
                bytes(*weight_bytes),
                WEIGHT_SHARE.0,
                WEIGHT_SHARE.1,
                if *offers == 1 { "worker offers" } else { "workers offer" },
                bytes(*offered)
            ),
            Self::Layers { layers, stages } => {
                write!(f, "the offers are too small: {stages} stages would be needed for {layers} layers")
            }
        }
    }
}

/// Decimal units, as memory is sold: "2.2 GB", "870.4 kB".
pub fn bytes(n: u64) -> String {
    let units = [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    match units.iter().find(|(_, size)| n as f64 >= *size) {
        Some((unit, size)) => format!("{:.1} {unit}", n as f64 / size),
        None => format!("{n} bytes"),
    }
}

/// Bytes of weights `memory` may hold.
fn weight_room(memory: u64) -> u128 {
    u128::from(memory) * u128::from(WEIGHT_SHARE.0) / u128::from(WEIGHT_SHARE.1)
}

/// The memory that holds `weights` bytes of weights.
fn memory_for(weights: u64) -> u64 {
    (u128::from(weights) * u128::from(WEIGHT_SHARE.1)).div_ceil(u128::from(WEIGHT_SHARE.0)) as u64
}

/// Plans over `offers` (in the order they came) for a model whose decoder
/// layers weigh `layer_weights` (parameters, one per layer);
/// `pipeline_size` is `--pipeline-parallel-size` when it asks for more
/// than one stage.
pub fn plan(offers: &[OfferedMemory], layer_weights: &[u64], pipeline_size: Option<usize>) -> Plan {
    let num_layers = layer_weights.len();
    if offers.is_empty() {
        return Plan::Wait(Shortfall::NoOffers);
    }
    // Offers of one model agree on its size unless their dtypes differ:
    // plan for the largest.
    let weights = offers.iter().map(|o| o.model_weight_bytes).max().unwrap_or(0);
    let fits = |o: &OfferedMemory| weight_room(o.memory) >= u128::from(weights);
    // Largest first; ties to the earlier offer.
    let mut by_memory: Vec<usize> = (0..offers.len()).collect();
    by_memory.sort_by_key(|&i| (std::cmp::Reverse(offers[i].memory), i));
    let chosen = match pipeline_size {
        None => {
            if let Some(i) = offers.iter().position(fits) {
                return Plan::Replica(i);
            }
            let mut room = 0u128;
            let count = by_memory.iter().position(|&i| {
                room += weight_room(offers[i].memory);
                room >= u128::from(weights)
            });
            match count {
                Some(last) => by_memory[..=last].to_vec(),
                None => return Plan::Wait(memory_shortfall(offers, weights)),
            }
        }
        Some(needed) if offers.len() < needed => {
            return Plan::Wait(Shortfall::Workers { needed, offered: offers.len() });
        }
        Some(needed) => {
            let chosen = by_memory[..needed].to_vec();
            let room: u128 = chosen.iter().map(|&i| weight_room(offers[i].memory)).sum();
            if room < u128::from(weights) {
                let picked: Vec<OfferedMemory> = chosen.iter().map(|&i| offers[i]).collect();
                return Plan::Wait(memory_shortfall(&picked, weights));
            }
            chosen
        }
    };
    let mut chosen = chosen;
    chosen.sort_unstable();
    let memory: Vec<u64> = chosen.iter().map(|&i| offers[i].memory).collect();
    match split_layers_by_weight(layer_weights, &memory) {
        Ok(ranges) => Plan::Pipeline(chosen.into_iter().zip(ranges).collect()),
        Err(_) => Plan::Wait(Shortfall::Layers { layers: num_layers, stages: chosen.len() }),
    }
}

fn memory_shortfall(offers: &[OfferedMemory], weights: u64) -> Shortfall {
    Shortfall::Memory {
        weight_bytes: weights,
        needed: memory_for(weights),
        offered: offers.iter().map(|o| o.memory).sum(),
        offers: offers.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offers(memory: &[u64]) -> Vec<OfferedMemory> {
        memory.iter().map(|&memory| OfferedMemory { memory, model_weight_bytes: 300 }).collect()
    }

    fn layers(plan: &Plan) -> Vec<(usize, String)> {
        match plan {
            Plan::Pipeline(stages) => stages.iter().map(|(i, r)| (*i, r.to_string())).collect(),
            other => panic!("not a pipeline: {other:?}"),
        }
    }

    /// GLM-4.5's dense first layer weighs a tenth of a mixture layer: two
    /// equal stages take layers 0-2 (21 of 51) and 3-5 (30), the cut
    /// closest to halves; with memory 2:1 the first takes 0-3 (31).
    #[test]
    fn stages_share_the_layers_by_weight() {
        let weights = [1, 10, 10, 10, 10, 10];
        assert_eq!(layers(&plan(&offers(&[1000, 1000]), &weights, Some(2))), [(0, "0-2".into()), (1, "3-5".into())]);
        assert_eq!(layers(&plan(&offers(&[2000, 1000]), &weights, Some(2))), [(0, "0-3".into()), (1, "4-5".into())]);
    }

    #[test]
    fn an_offer_that_holds_the_model_is_a_replica() {
        // 400 bytes hold 300 of weights (3/4); 399 do not.
        assert_eq!(plan(&offers(&[399, 400, 1000]), &[1; 22], None), Plan::Replica(1));
        assert_eq!(plan(&offers(&[1000]), &[1; 22], None), Plan::Replica(0));
    }

    #[test]
    fn offers_too_small_alone_are_split_in_proportion_to_memory() {
        // 200 + 150 hold 150 + 112 < 300; all three hold 337.
        let plan = plan(&offers(&[150, 100, 200]), &[1; 22], None);
        assert_eq!(layers(&plan), [(0, "0-6".into()), (1, "7-11".into()), (2, "12-21".into())]);
        // The fewest offers that hold the model, largest first, in the order they came.
        let plan2 = super::plan(&offers(&[100, 300, 10, 200]), &[1; 5], None);
        assert_eq!(layers(&plan2), [(1, "0-2".into()), (3, "3-4".into())]);
    }

    #[test]
    fn pipeline_size_takes_the_largest_offers() {
        assert_eq!(layers(&plan(&offers(&[1000, 1000]), &[1; 22], Some(2))), [(0, "0-10".into()), (1, "11-21".into())]);
        assert_eq!(layers(&plan(&offers(&[50, 1000, 500]), &[1; 5], Some(2))), [(1, "0-2".into()), (2, "3-4".into())]);
        assert_eq!(plan(&offers(&[1000]), &[1; 22], Some(2)), Plan::Wait(Shortfall::Workers { needed: 2, offered: 1 }));
    }

    #[test]
    fn too_little_memory_says_what_is_needed_and_offered() {
        let wait = plan(&offers(&[200, 100]), &[1; 22], None);
        assert_eq!(wait, Plan::Wait(Shortfall::Memory { weight_bytes: 300, needed: 400, offered: 300, offers: 2 }));
        let Plan::Wait(why) = wait else { unreachable!() };
        assert_eq!(
            why.to_string(),
            "the model needs 400 bytes of memory (300 bytes of weights, at most 3/4 of each worker's memory, the \
             rest for its KV cache); 2 workers offer 300 bytes in total"
        );
        let big = vec![OfferedMemory { memory: 1_400_000_000, model_weight_bytes: 2_200_000_000 }];
        let Plan::Wait(why) = plan(&big, &[1; 22], None) else { panic!() };
        assert!(why.to_string().contains("needs 2.9 GB of memory (2.2 GB of weights"), "{why}");
        assert!(why.to_string().ends_with("1 worker offers 1.4 GB in total"), "{why}");
        // With a pipeline size, only the offers it would take count.
        assert!(matches!(
            plan(&offers(&[200, 100, 50]), &[1; 22], Some(2)),
            Plan::Wait(Shortfall::Memory { offered: 300, .. })
        ));
        assert_eq!(plan(&[], &[1; 22], None), Plan::Wait(Shortfall::NoOffers));
    }

    #[test]
    fn more_stages_than_layers_waits() {
        assert_eq!(
            plan(&offers(&[100, 100, 100, 100]), &[1; 2], None),
            Plan::Wait(Shortfall::Layers { layers: 2, stages: 4 })
        );
    }
}
