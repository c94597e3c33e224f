//! The per-step cache of the Metal attention calls candle's composed path
//! makes (one per layer): the step's slot mapping and attention metadata
//! uploaded on its first call and found by the others, and the decode
//! scratch, kept across steps.

use std::sync::Arc;

use candle_core::DType;

use super::plan::{Allocator, AttentionPlan, words};
use crate::{AttentionMetadata, Dims, Result};

/// What an attention plan was built from.
#[derive(Debug, PartialEq)]
struct StepKey {
    meta: AttentionMetadata,
    dims: Dims,
    /// The activations' and the cache's.
    dtype: (DType, DType),
    scale_bits: u32,
}

/// One device's per-step state: the last step's plan and uploads, and the
/// decode scratch. Layers of a step find their metadata here; a new step
/// replaces it (a fresh upload, as the previous one may still be read by
/// queued GPU work: CPU writes into a buffer are not ordered with it).
#[derive(Debug)]
pub struct StepCache<B> {
    slots: Option<(Vec<u32>, B)>,
    attention: Option<(StepKey, Arc<AttentionPlan>, B)>,
    /// Capacity in bytes and the buffer. Only the GPU touches it, so queue
    /// order makes reuse safe, as for candle's own buffer pool.
    scratch: Option<(usize, B)>,
}

impl<B> Default for StepCache<B> {
    fn default() -> Self {
        Self { slots: None, attention: None, scratch: None }
    }
}

impl<B: Clone> StepCache<B> {
    /// The step's slot mapping on the GPU, uploaded on its first use.
    pub fn slots<A: Allocator<Buffer = B>>(&mut self, alloc: &mut A, slots: &[u32]) -> Result<B> {
        if let Some((cached, buffer)) = &self.slots
            && cached == slots
        {
            return Ok(buffer.clone());
        }
        let buffer = alloc.upload(&words(slots))?;
        self.slots = Some((slots.to_vec(), buffer.clone()));
        Ok(buffer)
    }

    /// The plan of an attention call, its metadata upload and the scratch
    /// it needs, built on the step's first call.
    pub fn attention<A: Allocator<Buffer = B>>(
        &mut self,
        alloc: &mut A,
        meta: &AttentionMetadata,
        dims: Dims,
        dtype: (DType, DType),
        scale: f32,
    ) -> Result<(Arc<AttentionPlan>, B, Option<B>)> {
        let hit = self.attention.as_ref().filter(|(key, _, _)| {
            key.dims == dims && key.dtype == dtype && key.scale_bits == scale.to_bits() && key.meta == *meta
        });
        let (plan, upload) = match hit {
            Some((_, plan, upload)) => (plan.clone(), upload.clone()),
            None => {
                let plan = Arc::new(AttentionPlan::new(meta, dims, dtype, scale)?);
                let upload = alloc.upload(plan.upload_bytes())?;
                let key = StepKey { meta: meta.clone(), dims, dtype, scale_bits: scale.to_bits() };
                self.attention = Some((key, plan.clone(), upload.clone()));
                (plan, upload)
            }
        };
        let need = plan.scratch_len();
        let scratch = if need == 0 {
            None
        } else {
            match &self.scratch {
                Some((capacity, buffer)) if *capacity >= need => Some(buffer.clone()),
                _ => {
                    // Grown geometrically, so longer contexts settle quickly.
                    let capacity = need.next_power_of_two();
                    let buffer = alloc.scratch(capacity)?;
                    self.scratch = Some((capacity, buffer.clone()));
                    Some(buffer)
                }
            }
        };
        Ok((plan, upload, scratch))
    }
}
