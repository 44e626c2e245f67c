//! Recording the work enqueued on the device's stream once and replaying it (CUDA graphs): a
//! decode step is hundreds of small launches, and a replay costs one.
//!
//! A recording keeps every kernel argument as it was, device addresses included, so what
//! changes from one replay to the next must be read from device memory by the kernels
//! ([`super::Position::Device`]), written before the replay is launched.

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{CudaDevice, CudaError};

/// The recorded work of one closure, replayable on the device's stream.
pub struct Graph {
    graph: CudaGraph,
}

// SAFETY: a CUDA graph may be used from any thread as long as no two threads use it at once
// (the driver's rule); `Graph` gives access only through `&self` methods of its one owner,
// and an owner that moves between threads does not use it from two at once.
unsafe impl Send for Graph {}

impl Graph {
    /// Enqueues the recorded work again.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.graph
            .launch()
            .map_err(CudaError::driver("cuGraphLaunch"))
    }
}

impl CudaDevice {
    /// Records what `work` enqueues on the stream instead of running it; nothing runs until
    /// [`Graph::launch`]. `work` must only enqueue: a wait, an upload or a download inside it
    /// fails (and the recording with it). Another thread's work on this stream meanwhile
    /// would be recorded too; the caller keeps it out.
    pub fn record<E: From<CudaError>>(
        &self,
        work: impl FnOnce() -> Result<(), E>,
    ) -> Result<Graph, E> {
        let stream = self.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("cuStreamBeginCapture"))?;
        let worked = work();
        // Capture always ends, so that the stream is usable again whatever happened.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        worked?;
        let graph = ended
            .map_err(CudaError::driver("cuStreamEndCapture"))?
            .ok_or_else(|| CudaError::invalid("record", "nothing was recorded"))?;
        Ok(Graph { graph })
    }
}
