//! [`BlockStorage`]: the memory of one block gathered ahead of the forward (ZeRO stage 3),
//! given back once the forward has moved past the block and gathered again when something
//! reads it — FSDP's reshard after forward and unshard before backward.
//!
//! On Burn's CPU backend a gathered parameter's values are its tensor's storage (each in a
//! [`ParamSlot`], a mapping of its own), so the tensors that Burn's autodiff keeps for the
//! backward (a matmul keeps its weight, or the weight reshaped) point at that memory. Instead
//! of recomputing activations to avoid keeping whole weights (gradient checkpointing), the
//! storage itself comes and goes:
//!
//! ```text
//! mark_block(block k+1)   block k's pages go back to the kernel (evict); the tensors stay
//! a read of block k       (the backward's matmul, or any other) finds it evicted: asks the
//!                         prefetch thread to gather it again, and the block before it too
//!                         (one ahead, as the backward goes), then waits for it
//! ```
//! A read always finds the values: whatever reads an evicted block restores it, so which
//! blocks are evicted decides only memory and time, never a value. The restores run on the
//! prefetch thread's group in the order the reads ask for them, which is the model's (the
//! same on every rank); reads come from the training thread (Burn's forward and backward).
//! A restore that fails reports the failure (`ShardComm::take_error`), as a failed gather
//! does, and the step fails with it; the values read meanwhile are zeros or partly gathered.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use burn::tensor::{Shape, Tensor, TensorData};

use crate::ddp::buckets::mapped::MappedBuffer;
use crate::ddp::fsdp::gathered_bytes::{as_tensor_data, GatheredBytes, Held, StorageValues};

/// Asks the prefetch thread to gather a block again (queued behind what it is doing).
pub(crate) type Restorer = Arc<dyn Fn(Arc<BlockStorage>) -> Result<(), String> + Send + Sync>;

/// Gathers parameter `i`'s whole values into its slot's buffer (the parameter, then padding),
/// or, for a slot no tensor uses any more (`None`), into a buffer of its own (the collective
/// still runs, on every rank alike); returns the bytes of the collective's buffer.
pub(crate) type GatherInto<'a> =
    &'a mut dyn FnMut(usize, Option<&mut [f32]>) -> Result<u64, String>;

/// Where each restore is reported: the bytes of its collective's buffer, or why it failed.
pub(crate) type RestoreReport = Arc<dyn Fn(Result<u64, String>) + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Resident,
    Evicted,
    Restoring,
}

/// One block's gathered parameters: their shards (to gather them again), their slots, and
/// whether their values are in memory now (module docs).
pub(crate) struct BlockStorage {
    /// This rank's shard of each parameter (tensor handles; unchanged until the optimizer
    /// steps, after the backward).
    pub shards: Vec<Tensor<1>>,
    /// Each whole parameter's size.
    pub numels: Vec<usize>,
    /// The parameters' slots, while their tensors live.
    slots: Mutex<Vec<Weak<ParamSlot>>>,
    state: Mutex<State>,
    /// `state == Resident`, read without the lock by every access.
    resident: AtomicBool,
    /// Set when the block is evicted; the first read after it asks for the block and the one
    /// before it. Taken at that read whatever the block's state then, so that what is asked
    /// for, and in which order, depends only on the order of the reads (the model's, the
    /// same on every rank), never on how far the prefetch thread has got.
    ask_on_read: AtomicBool,
    changed: Condvar,
    /// The block the forward ran before this one: the backward reads it next.
    before: Mutex<Option<Arc<BlockStorage>>>,
    links: StorageLinks,
}

/// What every block's storage of a rank shares: who gathers a block again and where that is
/// reported, the gauge of whole parameters in memory, and how long a read waits.
#[derive(Clone)]
pub(crate) struct StorageLinks {
    pub restorer: Restorer,
    pub report: RestoreReport,
    pub gauge: Arc<GatheredBytes>,
    /// How long a read waits for a restore.
    pub deadline: Duration,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl BlockStorage {
    /// The storage of a block just gathered (resident), and a slot for each parameter's
    /// `buffers` (the parameter's values first), counted in the links' gauge while resident.
    pub fn new(
        shards: Vec<Tensor<1>>,
        numels: Vec<usize>,
        buffers: Vec<MappedBuffer<f32>>,
        links: StorageLinks,
    ) -> (Arc<Self>, Vec<Arc<ParamSlot>>) {
        let block = Arc::new(Self {
            shards,
            numels: numels.clone(),
            slots: Mutex::new(Vec::new()),
            state: Mutex::new(State::Resident),
            resident: AtomicBool::new(true),
            ask_on_read: AtomicBool::new(false),
            changed: Condvar::new(),
            before: Mutex::new(None),
            links,
        });
        let slots: Vec<Arc<ParamSlot>> = buffers
            .into_iter()
            .zip(numels)
            .map(|(mut buffer, numel)| {
                let held = block
                    .links
                    .gauge
                    .hold(std::mem::size_of_val(&*buffer) as u64);
                Arc::new(ParamSlot {
                    len: numel.min(buffer.len()),
                    values: buffer.as_mut_ptr(),
                    buffer: UnsafeCell::new(buffer),
                    block: block.clone(),
                    held: Mutex::new(Some(held)),
                })
            })
            .collect();
        *lock(&block.slots) = slots.iter().map(Arc::downgrade).collect();
        (block, slots)
    }

    /// Records that the forward ran `before` just before this block (restored next, ahead of
    /// its read, when this one is restored).
    pub fn set_before(&self, before: Arc<BlockStorage>) {
        *lock(&self.before) = Some(before);
    }

    /// Gives the memory of the parameters back to the kernel; the next read gathers them
    /// again. For the training thread, outside any op (no read of the block in progress).
    pub fn evict(&self) {
        let mut state = lock(&self.state);
        if *state != State::Resident {
            return;
        }
        self.resident.store(false, Ordering::Release);
        self.ask_on_read.store(true, Ordering::Release);
        *state = State::Evicted;
        for slot in lock(&self.slots).iter().filter_map(Weak::upgrade) {
            // SAFETY: no read is in progress (the caller's contract) and none starts while
            // the block is not resident (reads wait for `Resident`); the thread that restores
            // only writes once a read has asked for it.
            let buffer = unsafe { &mut *slot.buffer.get() };
            let released = buffer.release_all();
            if let Some(held) = lock(&slot.held).as_mut() {
                held.shrink(released as u64);
            }
        }
    }

    /// Waits until the values are in memory, asking for them (and for the block before this
    /// one) when they are not. Up to the deadline; then, or when the restore failed, the
    /// values read as zeros and the failure is reported.
    fn ensure_resident(self: &Arc<Self>) {
        if self.ask_on_read.swap(false, Ordering::AcqRel) {
            self.request();
            let before = lock(&self.before).clone();
            if let Some(before) = before {
                before.request();
            }
        }
        if self.resident.load(Ordering::Acquire) {
            return;
        }
        let until = Instant::now() + self.links.deadline;
        let mut state = lock(&self.state);
        while *state != State::Resident {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                (self.links.report)(Err(format!(
                    "ZeRO stage 3: a block's parameters were not gathered again within {:?}",
                    self.links.deadline
                )));
                *state = State::Resident;
                self.resident.store(true, Ordering::Release);
                break;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Queues this block's restore if it is evicted and not queued yet.
    fn request(self: &Arc<Self>) {
        let mut state = lock(&self.state);
        if *state != State::Evicted {
            return;
        }
        *state = State::Restoring;
        drop(state);
        if let Err(e) = (self.links.restorer)(self.clone()) {
            self.fail(e);
        }
    }

    /// The restore (the prefetch thread): `gather(i, buffer)` for every parameter in order,
    /// under the block's state (no read runs until it is resident again; a read waiting for
    /// it waits for the collectives, which have the group's deadline). Reported either way
    /// (the bytes, or the first failure: the values are then zeros or partly gathered, and the
    /// step fails with it); wakes the reads waiting.
    pub fn restore(&self, gather: GatherInto<'_>) {
        let state = lock(&self.state);
        if *state != State::Restoring {
            return;
        }
        let slots = lock(&self.slots).clone();
        let mut outcome = Ok(0);
        for i in 0..self.numels.len() {
            let gathered = match slots.get(i).and_then(Weak::upgrade) {
                Some(slot) => {
                    // SAFETY: the block is restoring: no read runs until it is resident
                    // again (reads wait under `state`, held here).
                    let buffer = unsafe { &mut *slot.buffer.get() };
                    let bytes = std::mem::size_of_val(&**buffer) as u64;
                    *lock(&slot.held) = Some(self.links.gauge.hold(bytes));
                    gather(i, Some(&mut buffer[..]))
                }
                None => gather(i, None),
            };
            match (gathered, &mut outcome) {
                (Ok(bytes), Ok(total)) => *total += bytes,
                (Err(e), Ok(_)) => outcome = Err(e),
                (_, Err(_)) => {}
            }
        }
        (self.links.report)(outcome);
        self.become_resident(state);
    }

    /// A restore that could not be asked for: reported, and the values read as zeros.
    fn fail(&self, why: String) {
        let state = lock(&self.state);
        if *state != State::Restoring {
            return;
        }
        (self.links.report)(Err(why));
        self.become_resident(state);
    }

    fn become_resident(&self, mut state: MutexGuard<'_, State>) {
        *state = State::Resident;
        self.resident.store(true, Ordering::Release);
        self.changed.notify_all();
    }
}

/// One whole parameter's values in a mapping of their own, which its tensor uses as storage
/// (module docs).
pub(crate) struct ParamSlot {
    buffer: UnsafeCell<MappedBuffer<f32>>,
    /// The buffer's first value (a mapping does not move).
    values: *mut f32,
    /// The parameter's values: the first `len` of the buffer.
    len: usize,
    block: Arc<BlockStorage>,
    /// Its bytes in the rank's gauge, while resident.
    held: Mutex<Option<Held>>,
}

// SAFETY: the buffer is written only while its block is evicted or restoring, when no read of
// it runs (`BlockStorage` serialises both under its state); otherwise it is only read.
unsafe impl Sync for ParamSlot {}
// SAFETY: the pointer is into the mapping the slot owns, which does not move and is unmapped
// only when the slot is dropped, on whatever thread.
unsafe impl Send for ParamSlot {}

impl ParamSlot {
    /// A copy of the values (gathered again first if the block was given back).
    pub fn to_vec(&self) -> Vec<f32> {
        let (values, len) = SlotValues::access(self);
        // SAFETY: resident, initialised and unwritten while the training thread copies them
        // (`SlotValues::access`).
        unsafe { std::slice::from_raw_parts(values, len) }.to_vec()
    }

    /// The values as tensor data of `shape` (`f32`): the tensor's storage, evicted and
    /// restored with the block.
    pub fn into_tensor_data(self: Arc<Self>, shape: Shape) -> TensorData {
        as_tensor_data(SlotValues(self), shape)
    }
}

/// A tensor's storage that is a [`ParamSlot`].
struct SlotValues(Arc<ParamSlot>);

impl SlotValues {
    /// The slot's values, in memory: initialised, and nothing writes them until the training
    /// thread evicts the block, outside any op.
    fn access(slot: &ParamSlot) -> (*mut f32, usize) {
        slot.block.ensure_resident();
        (slot.values, slot.len)
    }
}

impl StorageValues for SlotValues {
    fn values_for_access(&self) -> (*mut f32, usize) {
        Self::access(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use burn::tensor::Device;

    use super::*;

    /// Parameter `i`'s value `j` in a block whose first parameter has `first` values.
    fn value(first: usize, i: usize, j: usize) -> f32 {
        ((first * 7 + i * 3 + j) % 1000) as f32 * 0.25
    }

    fn filled(first: usize, i: usize, numel: usize) -> MappedBuffer<f32> {
        let mut buffer = MappedBuffer::zeroed(numel).unwrap();
        for (j, v) in buffer.iter_mut().enumerate() {
            *v = value(first, i, j);
        }
        buffer
    }

    fn read(tensor: &Tensor<1>) -> Vec<f32> {
        tensor.to_data().try_to_vec::<f32>().unwrap()
    }

    /// Two blocks in slots, used as tensors' storage (no copy): evicted, their memory leaves
    /// the gauge and no value is lost; read, a block is gathered again (asked once, with the
    /// block the forward ran before it asked for ahead) and reads as before; dropped, nothing
    /// stays counted. The restorer plays the prefetch thread, from a thread of its own.
    #[test]
    fn an_evicted_block_is_gathered_again_when_read_and_reads_as_before() {
        let gauge = Arc::new(GatheredBytes::default());
        let asked = Arc::new(Mutex::new(Vec::new()));
        let restored = Arc::new(AtomicU64::new(0));
        let restorer: Restorer = {
            let asked = asked.clone();
            Arc::new(move |block: Arc<BlockStorage>| {
                asked.lock().unwrap().push(block.numels[0]);
                std::thread::spawn(move || {
                    let first = block.numels[0];
                    block.restore(&mut |i, out: Option<&mut [f32]>| {
                        let out = out.ok_or("every slot lives")?;
                        for (j, v) in out.iter_mut().enumerate() {
                            *v = value(first, i, j);
                        }
                        Ok(4 * out.len() as u64)
                    });
                });
                Ok(())
            })
        };
        let report: RestoreReport = {
            let restored = restored.clone();
            Arc::new(move |r| {
                restored.fetch_add(r.unwrap(), Ordering::Relaxed);
            })
        };
        let block = |numels: Vec<usize>| {
            let first = numels[0];
            let buffers = numels
                .iter()
                .enumerate()
                .map(|(i, &n)| filled(first, i, n))
                .collect();
            let (shards, deadline) = (Vec::new(), Duration::from_secs(60));
            let links = StorageLinks {
                restorer: restorer.clone(),
                report: report.clone(),
                gauge: gauge.clone(),
                deadline,
            };
            let (storage, slots) = BlockStorage::new(shards, numels.clone(), buffers, links);
            let device = Device::flex();
            let tensors: Vec<Tensor<1>> = slots
                .into_iter()
                .zip(&numels)
                .map(|(slot, &n)| {
                    Tensor::from_data(slot.into_tensor_data(Shape::new([n])), &device)
                })
                .collect();
            (storage, tensors)
        };
        let (a, a_tensors) = block(vec![40_000, 3]);
        let (b, b_tensors) = block(vec![20_000]);
        b.set_before(a.clone());
        let all = 4 * (40_000 + 3 + 20_000);
        assert_eq!(gauge.live(), all, "the slots are the tensors' storage");

        a.evict();
        b.evict();
        assert_eq!(gauge.live(), 0, "every page given back");
        assert_eq!(
            read(&b_tensors[0]),
            (0..20_000).map(|j| value(20_000, 0, j)).collect::<Vec<_>>()
        );
        for (i, tensor) in a_tensors.iter().enumerate() {
            let want: Vec<f32> = (0..[40_000, 3][i]).map(|j| value(40_000, i, j)).collect();
            assert_eq!(read(tensor), want, "parameter {i} of the block before");
        }
        assert_eq!(
            *asked.lock().unwrap(),
            vec![20_000, 40_000],
            "read once each: the block read, then the one before it, asked ahead"
        );
        assert_eq!(restored.load(Ordering::Relaxed), all, "each slot's bytes");
        assert_eq!(gauge.live(), all);
        // A read of a resident block asks for nothing.
        read(&b_tensors[0]);
        assert_eq!(asked.lock().unwrap().len(), 2);

        drop((a_tensors, b_tensors));
        assert_eq!(gauge.live(), 0, "the slots go with their tensors");
    }
}
