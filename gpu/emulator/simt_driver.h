// The emulator's scheduler, guarded memory and launch driver: the one translation unit that
// defines what simt_runtime.h declares (gpu/emulator/build.py compiles it with a main() that
// gathers every kernel object's entry table, and links). The process reads a launch file
// (gpu/emulator/launch.py writes it), runs its kernels one CTA at a time and writes the output
// arrays back; any fault or rule broken exits non-zero with a message on stderr.
#pragma once

#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace simt {

constexpr size_t kPage = 4096;
constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned char kPoison = 0xff;  // every byte 0xff: NaN in fp16, bf16 and fp32

static Cta g_cta;
static std::mt19937_64 g_rng;
static const char* g_kernel_name = "";

Cta& cta() { return g_cta; }

void fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fprintf(stderr, "simt: %s: ", g_kernel_name);
  if (g_cta.current != nullptr) {
    const dim3 b = g_cta.block_idx, t = g_cta.current->idx;
    fprintf(stderr, "block (%u, %u, %u) thread (%u, %u, %u): ", b.x, b.y, b.z, t.x, t.y, t.z);
  }
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
  fflush(stderr);
  _exit(2);
}

// ---- guarded memory ------------------------------------------------------------------------------
// Each region is [guard page][slack][bytes][guard page]: the bytes end 256 bytes or less before
// the trailing guard (aligned down to 256), so reading or writing past the end faults; the
// slack before the bytes holds poison that is checked afterwards (an underrun).
struct Region {
  std::string name;
  unsigned char* map = nullptr;
  size_t map_bytes = 0;
  unsigned char* data = nullptr;
  size_t bytes = 0;
};

static std::vector<Region*> g_regions;

Region* guarded_alloc(const std::string& name, size_t bytes, size_t align) {
  const size_t inner = (bytes + align + kPage - 1) / kPage * kPage;
  auto* region = new Region{name, nullptr, inner + 2 * kPage, nullptr, bytes};
  void* map = mmap(nullptr, region->map_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) fail("cannot map %zu bytes for %s", region->map_bytes, name.c_str());
  region->map = static_cast<unsigned char*>(map);
  unsigned char* end = region->map + kPage + inner;
  region->data = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(end) - bytes) & ~static_cast<uintptr_t>(align - 1));
  memset(region->map + kPage, kPoison, static_cast<size_t>(region->data - region->map - kPage));
  memset(region->data + bytes, kPoison, static_cast<size_t>(end - region->data - bytes));
  mprotect(region->map, kPage, PROT_NONE);
  mprotect(end, kPage, PROT_NONE);
  g_regions.push_back(region);
  return region;
}

void check_slack(const Region& region) {
  const unsigned char* end = region.map + region.map_bytes - kPage;
  for (const unsigned char* p = region.map + kPage; p < region.data; ++p) {
    if (*p != kPoison) fail("%s was written %td bytes before its start", region.name.c_str(), region.data - p);
  }
  for (const unsigned char* p = region.data + region.bytes; p < end; ++p) {
    if (*p != kPoison) fail("%s was written %td bytes past its end", region.name.c_str(), p - region.data - region.bytes + 1);
  }
}

static void on_fault(int signal, siginfo_t* info, void*) {
  const auto* address = static_cast<const unsigned char*>(info->si_addr);
  char where[256] = "outside every emulated array";
  for (const Region* region : g_regions) {
    if (address >= region->map && address < region->map + region->map_bytes) {
      snprintf(where, sizeof(where), "%s, %td bytes from its start (%zu bytes long)",
               region->name.c_str(), address - region->data, region->bytes);
    }
  }
  char message[512];
  const dim3 b = g_cta.block_idx;
  const int tid = g_cta.current ? g_cta.current->linear : -1;
  const int n = snprintf(message, sizeof(message),
                         "simt: %s: block (%u, %u, %u) thread %d: %s at %p: %s\n", g_kernel_name,
                         b.x, b.y, b.z, tid, signal == SIGSEGV ? "segfault" : "bus error",
                         info->si_addr, where);
  if (n > 0) (void)!write(2, message, static_cast<size_t>(n));
  _exit(3);
}

void install_fault_handler() {
  static std::vector<unsigned char> alt(64 * 1024);
  stack_t stack{};
  stack.ss_sp = alt.data();
  stack.ss_size = alt.size();
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &action, nullptr);
  sigaction(SIGBUS, &action, nullptr);
}

// ---- context switching ------------------------------------------------------------------------
static Body g_body = nullptr;
static void* const* g_args = nullptr;

[[noreturn]] void fiber_main();

#if defined(__x86_64__)
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl simt_switch
.type simt_switch,@function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size simt_switch, .-simt_switch
)");

void* initial_stack(unsigned char* stack, size_t bytes) {
  auto* top = reinterpret_cast<uint64_t*>(stack + bytes);  // 16-byte aligned
  *--top = 0;                                                // fiber_main's return slot
  *--top = reinterpret_cast<uint64_t>(&fiber_main);          // popped by ret
  for (int i = 0; i < 6; ++i) *--top = 0;                    // rbp rbx r12 r13 r14 r15
  *--top = 0x037f00001f80ull;                                 // mxcsr | x87 control word
  return top;
}
inline void switch_to(void** save, void* load) { simt_switch(save, load); }
#else
static std::vector<ucontext_t> g_contexts;  // [0]: scheduler, [1 + i]: thread i
static void ucontext_entry() { fiber_main(); }
void* initial_stack(unsigned char* stack, size_t bytes) { return nullptr; }
inline void switch_to(void** save, void* load) {
  swapcontext(static_cast<ucontext_t*>(*save), static_cast<ucontext_t*>(load));
}
#endif

void yield_to_scheduler() { switch_to(&g_cta.current->sp, g_cta.scheduler_sp); }

[[noreturn]] void fiber_main() {
  g_body(g_args);
  Thread* self = g_cta.current;
  if (!self->copies.empty()) {
    fail("exits with %zu cp.async copies in flight (they could land on reused shared memory)",
         self->copies.size());
  }
  self->done = true;
  for (;;) yield_to_scheduler();
}

// ---- warps and barriers ---------------------------------------------------------------------------
const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kMma: return "mma.sync";
    case WarpOp::kLdmatrix: return "ldmatrix";
  }
  return "?";
}

uint64_t warp_collective(WarpOp op, unsigned int mask, uint64_t value, int arg, int width,
                         const void* site) {
  Thread* self = g_cta.current;
  const int lane = self->linear & 31;
  if (!(mask >> lane & 1u)) fail("%s with a mask 0x%08x that leaves out its own lane %d", op_name(op), mask, lane);
  self->wait = Wait::kWarp;
  self->op = op;
  self->mask = mask;
  self->arg = arg;
  self->width = width;
  self->value = value;
  self->site = site;
  yield_to_scheduler();
  return self->result;
}

void barrier(const void* site) {
  Thread* self = g_cta.current;
  self->wait = Wait::kBarrier;
  self->site = site;
  yield_to_scheduler();
}

void warp_mma(const MmaOperands& operands, const void* site) {
  Thread* self = g_cta.current;
  self->payload = &operands;
  warp_collective(WarpOp::kMma, 0xffffffffu, 0, 0, 32, site);
}

float mma_element(uint32_t packed, int half, MmaKind kind) {
  const uint16_t bits = static_cast<uint16_t>(packed >> (16 * half));
  return kind == MmaKind::kBf16K16 ? __bfloat162float(__nv_bfloat16{bits})
                                   : __half2float(__half{bits});
}

float tf32_element(uint32_t bits) { return __uint_as_float(bits & 0xffffe000u); }

void complete_mma(Thread* lanes) {
  // Gather A (16xK), B (Kx8) and C (16x8) from the lanes' fragments, then scatter D.
  float a[16][16], b[16][8], c[16][8];
  const MmaKind kind = static_cast<const MmaOperands*>(lanes[0].payload)->kind;
  const int depth = kind == MmaKind::kTf32K8 ? 8 : 16;
  for (int lane = 0; lane < 32; ++lane) {
    const auto* op = static_cast<const MmaOperands*>(lanes[lane].payload);
    if (op->kind != kind) fail("mma.sync lanes disagree on the shape or the input type");
    const int g = lane / 4, t = lane % 4;
    if (kind == MmaKind::kTf32K8) {
      for (int i = 0; i < 4; ++i) a[g + 8 * (i & 1)][t + 4 * (i >> 1)] = tf32_element(op->a[i]);
      for (int i = 0; i < 2; ++i) b[t + 4 * i][g] = tf32_element(op->b[i]);
    } else {
      for (int i = 0; i < 4; ++i) {  // a[i]: rows g + 8 (i & 1), columns 2t + 8 (i >> 1) + {0, 1}
        const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
        a[row][col] = mma_element(op->a[i], 0, kind);
        a[row][col + 1] = mma_element(op->a[i], 1, kind);
      }
      for (int i = 0; i < 2; ++i) {  // b[i]: rows (k) 2t + 8 i + {0, 1}, column g
        b[2 * t + 8 * i][g] = mma_element(op->b[i], 0, kind);
        b[2 * t + 8 * i + 1][g] = mma_element(op->b[i], 1, kind);
      }
    }
    for (int i = 0; i < 4; ++i) c[g + 8 * (i >> 1)][2 * t + (i & 1)] = op->c[i];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const auto* op = static_cast<const MmaOperands*>(lanes[lane].payload);
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
      double sum = 0;  // products of 16-bit or tf32 inputs are exact; the sum is rounded once
      for (int k = 0; k < depth; ++k) sum += static_cast<double>(a[row][k]) * b[k][col];
      op->d[i] = static_cast<float>(sum + c[row][col]);
    }
  }
}

void warp_ldmatrix(const LdmatrixOperands& operands, const void* site) {
  Thread* self = g_cta.current;
  self->payload = &operands;
  warp_collective(WarpOp::kLdmatrix, 0xffffffffu, 0, 0, 32, site);
}

void complete_ldmatrix(Thread* lanes) {
  uint16_t m[4][8][8];  // [matrix][row][column]
  const bool trans = static_cast<const LdmatrixOperands*>(lanes[0].payload)->trans;
  for (int lane = 0; lane < 32; ++lane) {
    const auto* op = static_cast<const LdmatrixOperands*>(lanes[lane].payload);
    if (op->trans != trans) fail("ldmatrix lanes disagree on .trans");
    const auto* row = static_cast<const unsigned char*>(op->row);
    if (row < g_cta.smem || row + 16 > g_cta.smem + g_cta.smem_bytes) {
      g_cta.current = &lanes[lane];
      fail("ldmatrix row %p is outside the CTA's %zu bytes of shared memory", op->row,
           g_cta.smem_bytes);
    }
    if (reinterpret_cast<uintptr_t>(row) % 16) {
      g_cta.current = &lanes[lane];
      fail("ldmatrix row %p is not 16-byte aligned", op->row);
    }
    memcpy(m[lane / 8][lane % 8], row, 16);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const auto* op = static_cast<const LdmatrixOperands*>(lanes[lane].payload);
    const int r = lane / 4, c = 2 * (lane % 4);
    for (int i = 0; i < 4; ++i) {
      const uint16_t first = trans ? m[i][c][r] : m[i][r][c];
      const uint16_t second = trans ? m[i][c + 1][r] : m[i][r][c + 1];
      op->d[i] = static_cast<uint32_t>(first) | static_cast<uint32_t>(second) << 16;
    }
  }
}

// Completes the warp op `lead` waits at, if every lane of its mask has arrived there.
bool try_complete_warp(Thread* lead) {
  const int warp_base = lead->linear & ~31;
  const int n = static_cast<int>(g_cta.threads.size());
  Thread* lanes = &g_cta.threads[warp_base];
  for (int lane = 0; lane < 32; ++lane) {
    if (!(lead->mask >> lane & 1u)) continue;
    if (warp_base + lane >= n) fail("%s names lane %d, which the CTA does not have", op_name(lead->op), lane);
    const Thread& other = lanes[lane];
    if (other.done) {
      fail("%s at %p: lane %d of the mask has exited", op_name(lead->op), lead->site, lane);
    }
    if (other.wait != Wait::kWarp) return false;
    if (other.site != lead->site || other.mask != lead->mask || other.op != lead->op) {
      fail("divergent warp: lane %d waits at %s %p mask 0x%08x, lane %d at %s %p mask 0x%08x",
           lead->linear & 31, op_name(lead->op), lead->site, lead->mask, lane,
           op_name(other.op), other.site, other.mask);
    }
  }
  const unsigned int mask = lead->mask;
  if (lead->op == WarpOp::kMma || lead->op == WarpOp::kLdmatrix) {
    if (mask != 0xffffffffu) fail("%s needs the whole warp", op_name(lead->op));
    lead->op == WarpOp::kMma ? complete_mma(lanes) : complete_ldmatrix(lanes);
  }
  unsigned int ballot = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if (mask >> lane & 1u && lanes[lane].value) ballot |= 1u << lane;
  }
  for (int lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    Thread& t = lanes[lane];
    const int width = t.width, base = lane & ~(width - 1);
    int src = lane;
    switch (t.op) {
      case WarpOp::kShflXor: src = lane ^ t.arg; break;
      case WarpOp::kShflIdx: src = base + (t.arg & (width - 1)); break;
      case WarpOp::kShflDown: src = lane + t.arg < base + width ? lane + t.arg : lane; break;
      case WarpOp::kShflUp: src = lane - t.arg >= base ? lane - t.arg : lane; break;
      default: break;
    }
    switch (t.op) {
      case WarpOp::kShflXor:
      case WarpOp::kShflIdx:
      case WarpOp::kShflDown:
      case WarpOp::kShflUp:
        if (src < 0 || src > 31 || !(mask >> src & 1u)) {
          g_cta.current = &t;
          fail("%s reads lane %d, which is not in the mask 0x%08x", op_name(t.op), src, mask);
        }
        t.result = lanes[src].value;
        break;
      case WarpOp::kBallot: t.result = ballot; break;
      case WarpOp::kAny: t.result = ballot != 0; break;
      case WarpOp::kAll: t.result = ballot == mask; break;
      default: t.result = 0; break;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    if (mask >> lane & 1u) lanes[lane].wait = Wait::kNone;
  }
  return true;
}

// ---- cp.async ------------------------------------------------------------------------------------------
void cp_async(void* dst, const void* src, int src_bytes) {
  Thread* self = g_cta.current;
  auto* d = static_cast<unsigned char*>(dst);
  if (d < g_cta.smem || d + 16 > g_cta.smem + g_cta.smem_bytes) {
    fail("cp.async destination %p is outside the CTA's %zu bytes of shared memory", dst, g_cta.smem_bytes);
  }
  if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) {
    fail("cp.async of 16 bytes needs 16-byte aligned addresses, got %p <- %p", dst, src);
  }
  memset(d, kPoison, 16);  // NaN until a wait_group retires the copy
  self->copies.push_back({d, static_cast<const unsigned char*>(src), src_bytes, self->committed});
}

void cp_async_commit() { ++g_cta.current->committed; }

void cp_async_wait(int pending) {
  // Retires every committed group but the `pending` most recent (uncommitted copies stay).
  Thread* self = g_cta.current;
  const long long keep_from = self->committed - pending;
  std::vector<CpAsync> still;
  for (const CpAsync& copy : self->copies) {
    if (copy.group < keep_from) {
      memset(copy.dst, 0, 16);
      memcpy(copy.dst, copy.src, static_cast<size_t>(copy.src_bytes));
    } else {
      still.push_back(copy);
    }
  }
  self->copies.swap(still);
}

// ---- one CTA ------------------------------------------------------------------------------------------
void describe_blocked() {
  for (const Thread& t : g_cta.threads) {
    if (t.done) continue;
    fprintf(stderr, "  thread %d waits at %s %p\n", t.linear,
            t.wait == Wait::kBarrier ? "__syncthreads" : op_name(t.op), t.site);
  }
}

// The threads that can run, by warp. Even seeds: the next thread is any of them, uniformly (the
// warps advance nearly in step). Odd seeds: each CTA ranks its warps at random and the next
// thread is one of the highest-ranked warp's (the warps drift as far apart as barriers and
// warp operations allow: a race between a fast warp and a slow one shows up).
struct ReadySet {
  std::vector<std::vector<int>> by_warp;
  std::vector<int> rank;  // warp -> its rank (higher first); empty: uniform
  size_t count = 0;

  ReadySet(int threads, bool ranked) : by_warp((threads + 31) / 32) {
    if (ranked) {
      rank.resize(by_warp.size());
      for (size_t w = 0; w < rank.size(); ++w) rank[w] = static_cast<int>(w);
      std::shuffle(rank.begin(), rank.end(), g_rng);
    }
  }
  void push(int thread) {
    by_warp[thread / 32].push_back(thread);
    ++count;
  }
  int pop() {
    size_t warp = 0;
    if (rank.empty()) {
      size_t pick = std::uniform_int_distribution<size_t>(0, count - 1)(g_rng);
      while (pick >= by_warp[warp].size()) pick -= by_warp[warp++].size();
    } else {
      for (size_t w = 0; w < by_warp.size(); ++w) {
        if (!by_warp[w].empty() && (by_warp[warp].empty() || rank[w] > rank[warp])) warp = w;
      }
    }
    std::vector<int>& lanes = by_warp[warp];
    const size_t pick = std::uniform_int_distribution<size_t>(0, lanes.size() - 1)(g_rng);
    const int thread = lanes[pick];
    lanes[pick] = lanes.back();
    lanes.pop_back();
    --count;
    return thread;
  }
};

static unsigned long long g_seed = 0;

void run_cta(Body body, void* const* args, const dim3& block_idx) {
  Cta& c = g_cta;
  c.block_idx = block_idx;
  c.current = nullptr;
  memset(c.smem, kPoison, c.smem_bytes);
  const int n = static_cast<int>(c.threads.size());
  g_body = body;
  g_args = args;
  for (int i = 0; i < n; ++i) {
    Thread& t = c.threads[i];
    t.done = false;
    t.wait = Wait::kNone;
    t.copies.clear();
    t.committed = 0;
#if defined(__x86_64__)
    t.sp = initial_stack(t.stack, kStackBytes);
#else
    ucontext_t& context = g_contexts[1 + i];
    getcontext(&context);
    context.uc_stack.ss_sp = t.stack;
    context.uc_stack.ss_size = kStackBytes;
    context.uc_link = nullptr;
    makecontext(&context, ucontext_entry, 0);
    t.sp = &context;
#endif
  }
  ReadySet ready(n, g_seed % 2 == 1);
  for (int i = 0; i < n; ++i) ready.push(i);
  int live = n;
  while (live > 0) {
    if (ready.count == 0) {
      // Everyone alive is blocked: only a barrier every live thread reached can release them.
      const void* site = nullptr;
      bool all_at_barrier = true;
      for (const Thread& t : c.threads) {
        if (t.done) continue;
        if (t.wait != Wait::kBarrier || (site != nullptr && t.site != site)) all_at_barrier = false;
        site = t.site;
      }
      if (!all_at_barrier) {
        c.current = nullptr;
        fprintf(stderr, "simt: %s: block (%u, %u, %u): deadlock or divergent barrier:\n",
                g_kernel_name, block_idx.x, block_idx.y, block_idx.z);
        describe_blocked();
        _exit(2);
      }
      for (int i = 0; i < n; ++i) {
        if (!c.threads[i].done) {
          c.threads[i].wait = Wait::kNone;
          ready.push(i);
        }
      }
    }
    const int index = ready.pop();
    Thread& t = c.threads[index];
    c.current = &t;
#if defined(__x86_64__)
    switch_to(&c.scheduler_sp, t.sp);
#else
    c.scheduler_sp = &g_contexts[0];
    swapcontext(&g_contexts[0], static_cast<ucontext_t*>(t.sp));
#endif
    if (t.done) {
      --live;
    } else if (t.wait == Wait::kWarp && try_complete_warp(&t)) {
      const int base = index & ~31;
      for (int lane = 0; lane < 32; ++lane) {
        if (t.mask >> lane & 1u) ready.push(base + lane);
      }
    }
    c.current = nullptr;
  }
}

// ---- launches ----------------------------------------------------------------------------------------
std::string read_line(std::istream& in) {
  std::string line;
  if (!std::getline(in, line)) fail("launch file ends early");
  return line;
}

int run_launch_file(const std::vector<Entry>& entries, const char* path, bool list_only) {
  if (list_only) {
    for (const Entry& entry : entries) printf("%s\t%s\n", entry.name, entry.signature.c_str());
    return 0;
  }
  install_fault_handler();
  std::ifstream in(path);
  if (!in) fail("cannot read %s", path);
  // arrays: <count>, then per array: <bytes> <w 0|1> <path> on one line, its name on the next
  std::istringstream header(read_line(in));
  size_t num_arrays = 0;
  header >> num_arrays;
  std::vector<Region*> arrays;
  std::vector<std::pair<std::string, bool>> files;
  for (size_t i = 0; i < num_arrays; ++i) {
    std::istringstream fields(read_line(in));
    size_t bytes = 0;
    int writes = 0;
    std::string file;
    fields >> bytes >> writes >> file;
    Region* region = guarded_alloc(read_line(in), bytes, 256);
    std::ifstream data(file, std::ios::binary);
    if (!data.read(reinterpret_cast<char*>(region->data), static_cast<std::streamsize>(bytes))) {
      fail("cannot read %zu bytes of %s from %s", bytes, region->name.c_str(), file.c_str());
    }
    arrays.push_back(region);
    files.emplace_back(file, writes != 0);
  }
  std::istringstream count_line(read_line(in));
  size_t num_launches = 0;
  count_line >> num_launches;
  for (size_t l = 0; l < num_launches; ++l) {
    const std::string name = read_line(in);
    const Entry* entry = nullptr;
    for (const Entry& e : entries) {
      if (name == e.name) entry = &e;
    }
    if (entry == nullptr) fail("no kernel %s in this build", name.c_str());
    g_kernel_name = entry->name;
    std::istringstream shape(read_line(in));
    dim3 grid, block;
    size_t smem = 0;
    unsigned long long seed = 0;
    size_t num_args = 0;
    shape >> grid.x >> grid.y >> grid.z >> block.x >> block.y >> block.z >> smem >> seed >> num_args;
    // arguments: "p <array> <byte offset>" or "<code> <raw bits as unsigned decimal>"
    std::vector<uint64_t> storage(num_args);
    std::vector<void*> args(num_args);
    std::istringstream want(entry->signature);
    for (size_t a = 0; a < num_args; ++a) {
      std::istringstream fields(read_line(in));
      std::string code, expected;
      fields >> code;
      want >> expected;
      if (code != expected) fail("argument %zu: the kernel takes %s, the launch passes %s", a, expected.c_str(), code.c_str());
      if (code == "p") {
        size_t array = 0;
        long long offset = 0;
        fields >> array >> offset;
        unsigned char* base = array < arrays.size() ? arrays[array]->data : nullptr;
        storage[a] = reinterpret_cast<uint64_t>(base == nullptr ? nullptr : base + offset);
      } else {
        fields >> storage[a];
      }
      args[a] = &storage[a];
    }
    std::string extra;
    if (want >> extra) fail("the kernel takes more than the %zu arguments passed", num_args);
    Region* smem_region = guarded_alloc("shared memory", std::max<size_t>(smem, 16), 16);
    g_cta.smem = smem_region->data;
    g_cta.smem_bytes = smem;
    g_cta.grid_dim = grid;
    g_cta.block_dim = block;
    const size_t threads = static_cast<size_t>(block.x) * block.y * block.z;
    if (threads == 0 || threads > 1024) fail("%zu threads per CTA", threads);
    g_cta.threads.assign(threads, Thread{});
#if !defined(__x86_64__)
    g_contexts.assign(threads + 1, ucontext_t{});
#endif
    for (size_t i = 0; i < threads; ++i) {
      Thread& t = g_cta.threads[i];
      t.linear = static_cast<int>(i);
      t.idx.x = static_cast<unsigned>(i % block.x);
      t.idx.y = static_cast<unsigned>(i / block.x % block.y);
      t.idx.z = static_cast<unsigned>(i / (static_cast<size_t>(block.x) * block.y));
      t.stack = guarded_alloc("stack", kStackBytes, 16)->data;
    }
    g_rng.seed(seed);
    g_seed = seed;
    std::vector<dim3> order;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) order.push_back(dim3{x, y, z});
    std::shuffle(order.begin(), order.end(), g_rng);
    for (const dim3& b : order) run_cta(entry->invoke, args.data(), b);
    check_slack(*smem_region);
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    check_slack(*arrays[i]);
    if (!files[i].second) continue;
    std::ofstream out(files[i].first, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(arrays[i]->data), static_cast<std::streamsize>(arrays[i]->bytes));
    if (!out) fail("cannot write %s", files[i].first.c_str());
  }
  return 0;
}

}  // namespace simt
