/* Does a weight stream overlap AMX tile instructions? A standalone loop (docs/serving.md "Tiles"):
 * 64 MiB streamed in 32-byte pieces, each unpacked to 64 bytes and stored into one of two staging
 * buffers of BLK bytes (as the tile products stage codes), and/or tile loads + TDPBUSD per KiB
 * streamed, reading the other staging buffer (L2 when BLK > L1) or a 4 KiB buffer (L1).
 *
 *   gcc -O2 -march=native tools/amx_overlap.c -o /tmp/amx_overlap
 *   for m in 1 2 3 6 7; do /tmp/amx_overlap $m 65536; done
 *
 * mode bits: 1 stream and stage, 2 tile loads + TDPBUSD, 4 the tile loads from L1. An Intel CPU
 * with AMX (arch_prctl grants the tile state). Not a test. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static cfg_t CFG __attribute__((aligned(64))) = {1,0,{0},{64,64,64,64,64,64,64,64},{16,16,16,16,16,16,16,16}};
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* stream 64 MB as "rows" of 1 KB: unpack each 32 B to 64 B stores into buf[cur^1] (2 KB per row);
   tile loads (A) from buf[cur] + B from small L1 buffer; mode bits: 1 stage, 2 tiles, 4 tiles read L1 only */
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  size_t N = 64<<20; uint8_t *big = aligned_alloc(64,N); memset(big,1,N);
  int mode = atoi(argv[1]); int blk = atoi(argv[2]); /* staging buffer bytes per block */
  uint8_t *buf = aligned_alloc(64, 2*blk + 4096), *b = aligned_alloc(64,4096), *a = aligned_alloc(64, 4096); memset(buf,1,2*blk); memset(b,1,4096); memset(a,1,4096);
  _tile_loadconfig(&CFG);
  const __m512i m4 = _mm512_set1_epi8(15);
  for (int rep=0; rep<2; rep++){
  double t=now(); int cur=0; size_t pos=0;
  /* per block: blk/2 bytes streamed (staged into buf[cur^1]), tile ops over buf[cur]: blk/1024 A loads + DPs */
  while (pos + blk/2 <= N) {
    uint8_t *nx = buf + (cur^1)*blk, *cu = buf + cur*blk;
    size_t tl = 0, per = blk/1024; size_t chunk = blk/2/16; /* stream in 16 pieces interleaved with tiles */
    for (int piece=0; piece<16; piece++) {
      if (mode & 1) for (size_t i=0;i<chunk;i+=32){ const uint8_t *w = big+pos+piece*chunk+i; if(!(i&63)) _mm_prefetch((const char*)(w+8192),_MM_HINT_T1);
        __m256i v=_mm256_loadu_si256((const __m256i*)w); __m512i row=_mm512_inserti64x4(_mm512_castsi256_si512(v),_mm256_srli_epi16(v,4),1);
        _mm512_store_si512(nx + (piece*chunk+i)*2, _mm512_and_si512(row,m4)); }
      if (mode & 2) for (size_t k=0;k<per/16;k++,tl++){ _tile_loadd(4, (mode&4)? a : cu + tl*1024, 64); _tile_loadd(5, b, 64); _tile_dpbusd(0,4,5);} 
    }
    pos += blk/2; cur ^= 1;
  }
  _tile_stored(0, a, 64);
  double dt=now()-t; if(rep) printf("mode %d blk %d: %.2f ms (%.1f GB/s)\n",mode,blk,dt*1e3,N/dt/1e9);
  }
  _tile_release();
  return 0;
}
