//! NVRTC compilation for the device's own architecture, cached on disk across runs.
//!
//! A module compiles to a CUBIN for `sm_XY` (the device's compute capability), so loading it
//! needs no further JIT. The cache file is named by a hash of everything that changes the
//! output: the source, the architecture, the NVRTC version and the options. The cache lives in
//! `$EMBER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ember/kernels`, else `~/.cache/ember/kernels`;
//! failing to write it costs a warning and a compile next run, nothing more.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::error::CudaError;
use super::kernels::Module;

/// Options every module is compiled with (besides the architecture).
const OPTIONS: &[&str] = &["--std=c++17"];

/// Whether the NVRTC library loads (it compiles without a GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: the check only dlopens and closes the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// The NVRTC library's version, `(major, minor)`. Check [`nvrtc_present`] first: a missing
/// library panics here.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|source| CudaError::Nvrtc {
            op: "nvrtcVersion",
            source,
        })?;
    Ok((major, minor))
}

/// `f` of every module (or module and architecture, ...), several at once (a thread each, up to
/// the machine's cores), taken in the order given as threads come free: NVRTC compiles a
/// program on one thread, and a fresh cache would otherwise wait for each module in turn (the
/// decode attention's alone takes half a minute). Results in the order given.
pub fn in_parallel<M: Copy + Sync, T: Send>(modules: &[M], f: impl Fn(M) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(modules.len());
    if threads <= 1 {
        return modules.iter().map(|&m| f(m)).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, T)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&module) = modules.get(i) else { break };
                        mine.push((i, f(module)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, v)| v).collect()
}

/// The NVRTC architecture name for a compute capability: `(8, 9)` → `sm_89`. Hopper's is
/// `sm_90a`, its architecture-specific features (wgmma) included: the code runs on 9.0 alone,
/// which is the device it is compiled for.
pub fn arch_name((major, minor): (i32, i32)) -> String {
    let features = if (major, minor) == (9, 0) { "a" } else { "" };
    format!("sm_{major}{minor}{features}")
}

/// Compiles a module's `source` to a CUBIN for `arch` (`sm_90`). Check [`nvrtc_present`]
/// first.
pub fn compile_cubin(source: &str, module: Module, arch: &str) -> Result<Vec<u8>, CudaError> {
    compile_with_log(source, module, arch, &[]).map(|(cubin, _)| cubin)
}

/// [`compile_cubin`] with `extra` options after ember's own, returning NVRTC's log beside the
/// CUBIN: with `-Xptxas=-v`, ptxas's account of each kernel (registers, spills, and its
/// performance warnings, such as C7520 when it serialises a kernel's wgmma steps).
pub fn compile_with_log(
    source: &str,
    module: Module,
    arch: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, String), CudaError> {
    let nvrtc_err = |op| move |source| CudaError::Nvrtc { op, source };
    let src = CString::new(source).map_err(|_| CudaError::Compile {
        module: module.name(),
        arch: arch.into(),
        log: "the source holds a NUL byte".into(),
    })?;
    let name = CString::new(format!("{}.cu", module.name())).expect("module names hold no NUL");
    let prog = Program(
        nvrtc::create_program(&src, Some(name.as_c_str()))
            .map_err(nvrtc_err("nvrtcCreateProgram"))?,
    );
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is a live program; the options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog.0, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog.0) }
        .map(|raw| {
            // SAFETY: NVRTC's log is NUL-terminated.
            unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_else(|e| format!("(no log: {e})"));
    if compiled.is_err() {
        return Err(CudaError::Compile {
            module: module.name(),
            arch: arch.into(),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBINSize"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBIN"))?;
    Ok((cubin, log))
}

/// Destroys the program however compilation ends.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once here.
        if let Err(e) = unsafe { nvrtc::destroy_program(self.0) } {
            tracing::warn!("nvrtcDestroyProgram failed: {e}");
        }
    }
}

/// Compiles modules for one architecture, through the on-disk cache.
#[derive(Debug)]
pub(crate) struct Compiler {
    arch: String,
    nvrtc: (i32, i32),
    cache_dir: Option<PathBuf>,
}

impl Compiler {
    pub fn new(arch: String, nvrtc: (i32, i32)) -> Self {
        Compiler {
            arch,
            nvrtc,
            cache_dir: kernel_cache_dir(),
        }
    }

    /// The CUBIN of `module`, from the cache when `fresh` is false and a valid entry exists.
    pub fn cubin(&self, module: Module, fresh: bool) -> Result<Vec<u8>, CudaError> {
        let source = module.source();
        let path = self.cache_dir.as_ref().map(|dir| {
            dir.join(format!(
                "{}-{}-{:016x}.cubin",
                module.name(),
                self.arch,
                self.key(&source)
            ))
        });
        if let (Some(path), false) = (&path, fresh)
            && let Ok(bytes) = std::fs::read(path)
            && bytes.starts_with(b"\x7fELF")
        {
            return Ok(bytes);
        }
        let started = std::time::Instant::now();
        let cubin = compile_cubin(&source, module, &self.arch)?;
        tracing::debug!(
            "compiled {}.cu for {} in {:.0?}",
            module.name(),
            self.arch,
            started.elapsed()
        );
        if let Some(path) = &path
            && let Err(e) = write_atomically(path, &cubin)
        {
            tracing::warn!(
                "could not cache kernel {}: {e} (it is compiled again next run)",
                path.display()
            );
        }
        Ok(cubin)
    }

    fn key(&self, source: &str) -> u64 {
        let mut h = Fnv::new();
        h.write(source.as_bytes());
        h.write(self.arch.as_bytes());
        h.write(format!("nvrtc {}.{}", self.nvrtc.0, self.nvrtc.1).as_bytes());
        for option in OPTIONS {
            h.write(option.as_bytes());
        }
        h.0
    }
}

/// `$EMBER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ember/kernels`, else `~/.cache/ember/kernels`.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("EMBER_KERNEL_CACHE") {
        return Some(dir.into());
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("ember/kernels"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache/ember/kernels"))
}

/// Writes beside the target and renames, so a reader never sees half a file.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// FNV-1a, 64 bits: stable across Rust releases (unlike `DefaultHasher`), so cache names are.
/// Each field ends with a 0xff byte, which UTF-8 text never holds, so fields cannot run
/// together.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().chain(&[0xff]) {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_change_with_source_arch_and_version() {
        let compiler = |arch: &str, nvrtc| Compiler {
            arch: arch.into(),
            nvrtc,
            cache_dir: None,
        };
        let (a, b, c) = (
            compiler("sm_90", (13, 0)),
            compiler("sm_89", (13, 0)),
            compiler("sm_90", (13, 1)),
        );
        let k = a.key("x");
        assert_ne!(k, a.key("y"));
        assert_ne!(k, b.key("x"));
        assert_ne!(k, c.key("x"));
        assert_eq!(k, a.key("x"));
        assert_eq!(arch_name((9, 0)), "sm_90a");
        assert_eq!(arch_name((8, 9)), "sm_89");
    }

    #[test]
    fn a_cache_write_into_an_unwritable_place_is_an_error_not_a_panic() {
        let blocker =
            std::env::temp_dir().join(format!("ember-cache-blocker-{}", std::process::id()));
        std::fs::write(&blocker, b"file, not a directory").unwrap();
        assert!(write_atomically(&blocker.join("k.cubin"), b"x").is_err());
        std::fs::remove_file(&blocker).unwrap();
    }
}
