//! A pass's inputs on the device (positions, token ids, the sequences' block tables), the
//! greedy picks that run ahead of the host, and the recorded decode graphs.
//!
//! The kernels read a pass's positions, tokens and block tables from device memory, never
//! from launch arguments, so a decode pass (one token, or one token of each of several
//! sequences) is recorded as a CUDA graph the second time its shape and pool are seen and
//! replayed from then on, each replay reading its own inputs.

use ember_tensor::cuda::{
    self, CudaDevice, DecodeRows, DevSlice, DevSliceMut, DeviceBuffer, Graph, Position, StreamEvent,
};
use ember_tensor::{Buffer, BufferId, BufferKind, BufferOwner};

use super::CudaBackend;
use super::kv::CudaKvPool;
use crate::backend::{PICKS_AHEAD, PassSegment, PassShape};
use crate::error::{Error, Result};
use crate::kv_cache::BlockTable;

/// Offsets in the step buffer: `[pos0, pos0 + n, token ids (max_batch), each row's position
/// (max_batch), each row's sequence (max_batch), the row indices 0, 1, .. (max_batch, set
/// once), the rows of the sequences that decode one token (max_sequences), block tables
/// (max_sequences · max_blocks)]`. A pass of one sequence
/// reads its positions from the first two (which a fed pass's pick advances on the device),
/// a pass of several from the rows'.
const STEP_POS0: usize = 0;
const STEP_END: usize = 1;
const STEP_TOKENS: usize = 2;

/// The pass's inputs as the kernels read them (i32), and their host side.
pub(super) struct PassInputs {
    device: CudaDevice,
    step: DeviceBuffer,
    /// A staging buffer, page-locked with the driver while the residency set holds it.
    host: Buffer,
    max_batch: usize,
    max_sequences: usize,
    /// Entries of a block table: the blocks of the longest sequence.
    max_blocks: usize,
    /// The last pass's rows, sequences, and sequences of one row (decode rows).
    rows: usize,
    sequences: usize,
    decode_rows: usize,
    /// The blocks of the table on the device: a fed pass uploads only those added since.
    table: Vec<u32>,
    /// Whether a fed pass's upload from `host` may still be in flight.
    upload_in_flight: bool,
}

impl PassInputs {
    pub(super) fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        max_batch: usize,
        max_sequences: usize,
        max_blocks: usize,
    ) -> Result<Self> {
        let len = (STEP_TOKENS + 4 * max_batch + max_sequences * (1 + max_blocks)) * 4;
        let mut step = owner.alloc_device(BufferKind::Activations, "pass inputs", device, len)?;
        let mut host = owner.alloc_staging(BufferKind::Activations, "pass inputs (host)", len)?;
        // The row indices: the host side keeps them, since every upload copies its range.
        let ids = STEP_TOKENS + 3 * max_batch..STEP_TOKENS + 4 * max_batch;
        let host_ids = &mut host.as_mut_slice::<i32>()[ids.clone()];
        for (i, id) in host_ids.iter_mut().enumerate() {
            *id = int(i);
        }
        device.upload(&mut step.as_mut_slice::<i32>().slice_mut(ids), host_ids)?;
        Ok(PassInputs {
            device: device.clone(),
            step,
            host,
            max_batch,
            max_sequences,
            max_blocks,
            rows: 0,
            sequences: 0,
            decode_rows: 0,
            table: Vec::with_capacity(max_blocks),
            upload_in_flight: false,
        })
    }

    fn row_pos_at(&self) -> usize {
        STEP_TOKENS + self.max_batch
    }

    fn row_seq_at(&self) -> usize {
        STEP_TOKENS + 2 * self.max_batch
    }

    fn row_ids_at(&self) -> usize {
        STEP_TOKENS + 3 * self.max_batch
    }

    fn decode_rows_at(&self) -> usize {
        STEP_TOKENS + 4 * self.max_batch
    }

    /// Where sequence 0's block table starts; sequence `s`'s is `s · max_blocks` after.
    fn table_at(&self) -> usize {
        self.decode_rows_at() + self.max_sequences
    }

    fn check_table(&self, table: &BlockTable) -> Result<()> {
        if table.blocks().len() > self.max_blocks {
            return Err(Error::Unsupported {
                what: format!(
                    "a block table of {} blocks (the backend was made for {})",
                    table.blocks().len(),
                    self.max_blocks
                ),
                backend: "CUDA",
            });
        }
        Ok(())
    }

    /// Waits for a fed pass's table upload, which may still be reading the staging buffer.
    fn finish_upload(&mut self) -> Result<()> {
        if self.upload_in_flight {
            self.device.synchronize()?;
            self.upload_in_flight = false;
        }
        Ok(())
    }

    /// Uploads a pass of host tokens after `table`'s positions: positions, ids and the whole
    /// table, in one copy, and waits for it.
    pub(super) fn set(&mut self, tokens: &[u32], table: &BlockTable) -> Result<()> {
        self.check_table(table)?;
        self.finish_upload()?;
        let (pos0, table_at, blocks) = (table.len(), self.table_at(), table.blocks());
        let (pos_at, seq_at) = (self.row_pos_at(), self.row_seq_at());
        let len = table_at + blocks.len();
        let host = &mut self.host.as_mut_slice::<i32>()[..len];
        host[STEP_POS0] = int(pos0);
        host[STEP_END] = int(pos0 + tokens.len());
        for (slot, &t) in host[STEP_TOKENS..].iter_mut().zip(tokens) {
            *slot = t as i32;
        }
        // Each row's position and sequence too, for prompt rows attending as decode rows
        // ([`Self::row_span`]).
        for i in 0..tokens.len() {
            host[pos_at + i] = int(pos0 + i);
            host[seq_at + i] = 0;
        }
        for (slot, &b) in host[table_at..].iter_mut().zip(blocks) {
            *slot = b as i32;
        }
        let mut step = self.step.as_mut_slice::<i32>();
        self.device.upload(&mut step.slice_mut(0..len), host)?;
        self.table.clear();
        self.table.extend_from_slice(blocks);
        (self.rows, self.sequences) = (tokens.len(), 1);
        self.decode_rows = usize::from(tokens.len() == 1);
        Ok(())
    }

    /// Uploads a pass over several sequences: `tokens` are the segments' one after another,
    /// each at the positions after its table's. Each row's position and sequence, the rows
    /// of the sequences that decode one token, and every table go up in one copy, waited for.
    pub(super) fn set_batch(&mut self, tokens: &[u32], segments: &[PassSegment<'_>]) -> Result<()> {
        if segments.len() > self.max_sequences {
            return Err(Error::Unsupported {
                what: format!(
                    "a pass over {} sequences (the backend was made for {})",
                    segments.len(),
                    self.max_sequences
                ),
                backend: "CUDA",
            });
        }
        for s in segments {
            self.check_table(s.table)?;
        }
        self.finish_upload()?;
        let (pos_at, seq_at, decode_at, table_at) = (
            self.row_pos_at(),
            self.row_seq_at(),
            self.decode_rows_at(),
            self.table_at(),
        );
        let len = table_at + segments.len() * self.max_blocks;
        let host = &mut self.host.as_mut_slice::<i32>()[..len];
        for (slot, &t) in host[STEP_TOKENS..].iter_mut().zip(tokens) {
            *slot = t as i32;
        }
        let (mut row, mut decode) = (0, 0);
        for (seq, s) in segments.iter().enumerate() {
            let pos0 = s.table.len();
            for i in 0..s.rows {
                host[pos_at + row + i] = int(pos0 + i);
                host[seq_at + row + i] = int(seq);
            }
            if s.rows == 1 {
                host[decode_at + decode] = int(row);
                decode += 1;
            }
            let at = table_at + seq * self.max_blocks;
            for (slot, &b) in host[at..].iter_mut().zip(s.table.blocks()) {
                *slot = b as i32;
            }
            row += s.rows;
        }
        debug_assert_eq!(row, tokens.len());
        let mut step = self.step.as_mut_slice::<i32>();
        self.device.upload(&mut step.slice_mut(0..len), host)?;
        // A fed pass continues one sequence's pass, never a batch's.
        self.table.clear();
        (self.rows, self.sequences, self.decode_rows) = (row, segments.len(), decode);
        Ok(())
    }

    /// Whether the last pass set was over several sequences ([`Self::set_batch`]).
    pub(super) fn is_batch(&self) -> bool {
        self.sequences > 1
    }

    /// Rows of the last pass set.
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// Sequences of the last pass set that decode one token.
    pub(super) fn decode_row_count(&self) -> usize {
        self.decode_rows
    }

    /// A fed pass: its token and positions were advanced on the device by the pick before
    /// (`cuda::argmax`'s feed); the blocks `table` gained since go up without waiting, so
    /// the device need not drain between steps.
    pub(super) fn extend_table(&mut self, table: &BlockTable) -> Result<()> {
        self.check_table(table)?;
        let blocks = table.blocks();
        if !blocks.starts_with(&self.table) {
            return Err(Error::Unsupported {
                what: "a fed pass over a block table that is not the last pass's, extended".into(),
                backend: "CUDA",
            });
        }
        let new = self.table_at() + self.table.len()..self.table_at() + blocks.len();
        if new.is_empty() {
            return Ok(());
        }
        let host = &mut self.host.as_mut_slice::<i32>()[new.clone()];
        for (slot, &b) in host.iter_mut().zip(&blocks[self.table.len()..]) {
            *slot = b as i32;
        }
        let mut step = self.step.as_mut_slice::<i32>();
        // SAFETY: these staging entries are written again only by a later `extend_table`
        // (other entries: the table only grows between passes of host tokens) or by `set`,
        // which waits for the stream first; Drop waits too.
        unsafe {
            self.device.upload_async(
                &mut step.slice_mut(new.clone()),
                &self.host.as_slice::<i32>()[new],
            )?;
        }
        self.upload_in_flight = true;
        self.table.extend_from_slice(&blocks[self.table.len()..]);
        Ok(())
    }

    pub(super) fn pos0(&self) -> Position<'_> {
        Position::Device(self.step.as_slice().slice(STEP_POS0..STEP_POS0 + 1))
    }

    /// The position after the pass's last token.
    pub(super) fn end(&self) -> Position<'_> {
        Position::Device(self.step.as_slice().slice(STEP_END..STEP_END + 1))
    }

    pub(super) fn tokens(&self, n: usize) -> DevSlice<'_, u32> {
        self.step.as_slice().slice(STEP_TOKENS..STEP_TOKENS + n)
    }

    /// Where the first position (row `first_row`'s) and the blocks of the pass's sequence
    /// `seq` are: a pass of one sequence keeps them apart (a fed pass's pick advances its
    /// position on the device), a pass of several has every row's.
    pub(super) fn segment(
        &self,
        first_row: usize,
        seq: usize,
    ) -> (Position<'_>, DevSlice<'_, i32>) {
        if self.is_batch() {
            (self.row_position(first_row), self.sequence_table(seq))
        } else {
            (self.pos0(), self.table())
        }
    }

    /// The sequence's blocks, as many entries as the longest sequence has.
    pub(super) fn table(&self) -> DevSlice<'_, i32> {
        self.sequence_table(0)
    }

    /// Sequence `seq`'s blocks in a pass over several.
    pub(super) fn sequence_table(&self, seq: usize) -> DevSlice<'_, i32> {
        let at = self.table_at() + seq * self.max_blocks;
        self.step.as_slice().slice(at..at + self.max_blocks)
    }

    /// Every sequence's table, `max_blocks` entries apart.
    pub(super) fn tables(&self) -> DevSlice<'_, i32> {
        let at = self.table_at();
        let len = self.max_sequences * self.max_blocks;
        self.step.as_slice().slice(at..at + len)
    }

    /// The position of row `row` in a pass over several sequences.
    pub(super) fn row_position(&self, row: usize) -> Position<'_> {
        let at = self.row_pos_at() + row;
        Position::Device(self.step.as_slice().slice(at..at + 1))
    }

    /// The decode rows of a pass over several sequences, as the decode kernels take them.
    pub(super) fn decode_rows(&self) -> DecodeRows<'_> {
        let at = self.decode_rows_at();
        self.rows_at(at..at + self.decode_rows)
    }

    /// Rows `rows` of the pass, each as a decode row over its own sequence's positions up to
    /// its own (a prompt chunk's rows: [`Self::set`] and [`Self::set_batch`] give every row
    /// its position and sequence).
    pub(super) fn row_span(&self, rows: std::ops::Range<usize>) -> DecodeRows<'_> {
        let at = self.row_ids_at();
        self.rows_at(at + rows.start..at + rows.end)
    }

    fn rows_at(&self, rows: std::ops::Range<usize>) -> DecodeRows<'_> {
        let step = self.step.as_slice::<i32>();
        let (pos, seq) = (self.row_pos_at(), self.row_seq_at());
        DecodeRows {
            rows: step.slice(rows),
            row_pos: step.slice(pos..pos + self.max_batch),
            row_seq: step.slice(seq..seq + self.max_batch),
            table_stride: self.max_blocks,
        }
    }

    /// All of them, for the pick that advances them (`cuda::argmax`'s feed).
    pub(super) fn step_mut(&mut self) -> DevSliceMut<'_, i32> {
        self.step.as_mut_slice()
    }
}

impl Drop for PassInputs {
    fn drop(&mut self) {
        if self.upload_in_flight
            && let Err(e) = self.device.synchronize()
        {
            tracing::warn!("waiting for the device before freeing the pass inputs failed: {e}");
        }
    }
}

/// The picks of [`crate::Backend::pick_ahead`]: pick `i` lands in slot `i % PICKS_AHEAD` of
/// `greedy_host`, and `landed[slot]` completes when it has.
pub(super) struct PicksAhead {
    pub(super) landed: [StreamEvent; PICKS_AHEAD],
    /// Picks enqueued and picks read since the last pass of host tokens.
    pub(super) enqueued: usize,
    pub(super) read: usize,
}

/// What a recorded pass is bound to: its shape and the pool its kernels address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    shape: PassShape,
    pool: BufferId,
}

pub(super) enum Recording {
    /// Seen once, run unrecorded: every kernel it uses is loaded, so none loads while recording.
    Warm,
    Ready(Graph),
    /// Recording failed once (logged); this shape runs unrecorded.
    Failed,
}

/// Graphs kept at most: one per pass shape (a decode batch's size) and pool.
const MAX_GRAPHS: usize = 160;

/// `v` as the kernels' int: positions and rows are bounded by the context and the batch.
fn int(v: usize) -> i32 {
    i32::try_from(v).expect("positions fit the kernels' int")
}

impl CudaBackend {
    /// Enqueues the greedy pick of the last pass's first row of logits into `greedy`; with
    /// `feed`, also as the token of the next pass (`cuda::argmax`'s feed).
    fn pick_greedy(&mut self, vocab: usize, feed: bool) -> Result<()> {
        let logits = self.logits.as_slice::<f32>().slice(0..vocab);
        let mut step = self.inputs.step_mut();
        cuda::argmax(
            &self.device,
            logits,
            vocab,
            &mut self.greedy.as_mut_slice::<u32>().slice_mut(0..1),
            feed.then_some(&mut step),
            &mut self.argmax_scratch.as_mut_slice::<u32>(),
        )?;
        Ok(())
    }

    /// Drops the picks still unread after waiting for the device, so that the staging slots
    /// are free: a pass of host tokens, or a pick the host waits for, starts a fresh run.
    pub(super) fn forget_picks_ahead(&mut self) -> Result<()> {
        if self.ahead.enqueued > self.ahead.read {
            self.device.synchronize()?;
        }
        self.ahead.enqueued = 0;
        self.ahead.read = 0;
        Ok(())
    }

    /// [`crate::Backend::run_pass`]: decode steps recorded once and replayed.
    pub(super) fn run_recorded(
        &mut self,
        kv: &mut CudaKvPool,
        shape: PassShape,
        pass: &mut dyn FnMut(&mut Self, &mut CudaKvPool) -> Result<()>,
    ) -> Result<()> {
        let key = GraphKey {
            shape,
            pool: kv.pool_id(),
        };
        // Only decode steps (a token a sequence): they are launch-bound, and their kernels
        // never wait on the host.
        let Some(graphs) = self.graphs.as_mut().filter(|_| shape.is_decode()) else {
            return pass(self, kv);
        };
        match graphs.get(&key) {
            Some(Recording::Ready(graph)) => return Ok(graph.launch()?),
            Some(Recording::Failed) => return pass(self, kv),
            Some(Recording::Warm) => {}
            None => {
                if graphs.len() >= MAX_GRAPHS {
                    // Pools come and go with engines; their graphs are cheap to record again.
                    graphs.clear();
                }
                graphs.insert(key, Recording::Warm);
                return pass(self, kv);
            }
        }
        let device = self.device.clone();
        let recorded = device.record(|| pass(self, kv));
        let graphs = self.graphs.as_mut().expect("recording is on");
        match recorded {
            Ok(graph) => {
                graph.launch()?;
                graphs.insert(key, Recording::Ready(graph));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(
                    "recording a decode step as a CUDA graph failed, so it runs op by op: {e}"
                );
                graphs.insert(key, Recording::Failed);
                pass(self, kv)
            }
        }
    }

    /// [`crate::Backend::begin_pass`].
    pub(super) fn begin_host_pass(&mut self, tokens: &[u32], table: &BlockTable) -> Result<()> {
        self.forget_picks_ahead()?;
        self.inputs.set(tokens, table)
    }

    /// [`crate::Backend::begin_fed_pass`].
    pub(super) fn begin_fed(&mut self, table: &BlockTable) -> Result<()> {
        // The pick before advanced the pass inputs on the device (`cuda::argmax`'s `feed`),
        // and the host cannot check their position without waiting for it.
        if self.ahead.enqueued == 0 {
            return Err(Error::NoTokens);
        }
        self.inputs.extend_table(table)
    }

    /// [`crate::Backend::greedy_token`].
    pub(super) fn pick_now(&mut self, vocab: usize) -> Result<u32> {
        self.forget_picks_ahead()?;
        self.pick_greedy(vocab, false)?;
        // Staging buffers are whole pages: the token is the first 4 bytes of this one.
        let host = &mut self.greedy_host.as_mut_slice::<u32>()[..1];
        self.device
            .download(self.greedy.as_slice::<u32>().slice(0..1), host)?;
        Ok(host[0])
    }

    /// [`crate::Backend::greedy_tokens`]: every row's pick in one launch, then only the picks
    /// to the host.
    pub(super) fn pick_rows(&mut self, rows: usize, vocab: usize) -> Result<Vec<u32>> {
        self.forget_picks_ahead()?;
        let logits = self.logits.as_slice::<f32>().slice(0..rows * vocab);
        cuda::argmax(
            &self.device,
            logits,
            vocab,
            &mut self.greedy.as_mut_slice::<u32>().slice_mut(0..rows),
            None,
            &mut self.argmax_scratch.as_mut_slice::<u32>(),
        )?;
        let host = &mut self.greedy_host.as_mut_slice::<u32>()[..rows];
        self.device
            .download(self.greedy.as_slice::<u32>().slice(0..rows), host)?;
        Ok(host.to_vec())
    }

    /// [`crate::Backend::pick_ahead`].
    pub(super) fn enqueue_pick(&mut self, vocab: usize) -> Result<()> {
        let ahead = &self.ahead;
        if ahead.enqueued - ahead.read >= PICKS_AHEAD {
            return Err(Error::Unsupported {
                what: format!("more than {PICKS_AHEAD} picks waiting unread"),
                backend: "cuda",
            });
        }
        let slot = ahead.enqueued % PICKS_AHEAD;
        self.pick_greedy(vocab, true)?;
        let host = &mut self.greedy_host.as_mut_slice::<u32>()[slot..slot + 1];
        // SAFETY: the slot is read (`read_pick`) only after its event, and not written again
        // before that read (at most PICKS_AHEAD wait); every path that drops or reuses the
        // staging buffer synchronises the stream first (`forget_picks_ahead`, Drop).
        unsafe {
            self.device
                .download_async(self.greedy.as_slice::<u32>().slice(0..1), host)?;
        }
        self.device.mark(&self.ahead.landed[slot])?;
        self.ahead.enqueued += 1;
        Ok(())
    }

    /// [`crate::Backend::read_pick`].
    pub(super) fn take_pick(&mut self) -> Result<u32> {
        let ahead = &mut self.ahead;
        if ahead.read == ahead.enqueued {
            return Err(Error::NoTokens);
        }
        let slot = ahead.read % PICKS_AHEAD;
        ahead.landed[slot].wait()?;
        ahead.read += 1;
        Ok(self.greedy_host.as_slice::<u32>()[slot])
    }
}

/// A fresh [`PicksAhead`].
pub(super) fn picks_ahead(device: &CudaDevice) -> Result<PicksAhead> {
    Ok(PicksAhead {
        landed: [device.new_event()?, device.new_event()?],
        enqueued: 0,
        read: 0,
    })
}
