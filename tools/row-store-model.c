// The least a row store of phub's shape can do on a machine, to set
// `phub-bench sparse --engine-only` beside (BENCHMARKS.md, "The row store at
// 10^8 rows: what stalls it"): a linear-probing index of 16-byte entries at
// 3/4 load and rows of 16 values + 16 Adagrad accumulators (128 B), both on
// transparent huge pages; N rows preloaded, then batches of 4096 uniformly
// drawn stored ids updated with the store's two-stage prefetch (index entry
// 16 ids ahead, row 8 ahead). No eviction, admission, snapshots, counters or
// bounds checks.
//
// Build and run: gcc -O3 -march=native -o row-store-model tools/row-store-model.c -lm
//                ./row-store-model ROWS [UPDATES]
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <sys/mman.h>
typedef struct { uint64_t id; uint32_t slot1; uint32_t touch; } Entry;
static inline uint64_t mix(uint64_t x){x^=x>>33;x*=0xff51afd7ed558ccdULL;x^=x>>33;x*=0xc4ceb9fe1a85ec53ULL;x^=x>>33;return x;}
static inline uint64_t splitmix(uint64_t x){x+=0x9E3779B97F4A7C15ULL;x=(x^(x>>30))*0xBF58476D1CE4E5B9ULL;x=(x^(x>>27))*0x94D049BB133111EBULL;return x^(x>>31);}
static void *huge(size_t n){void*p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);madvise(p,n,MADV_HUGEPAGE);return p;}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define D 16
#define AHEAD 8
int main(int argc,char**argv){
  uint64_t n=strtoull(argv[1],0,10), ops=argc>2?strtoull(argv[2],0,10):20000000ULL;
  uint64_t cap=(n*4/3)|1; Entry*idx=huge(cap*sizeof(Entry)); float*rows=huge(n*2*D*sizeof(float));
  uint32_t next=0;
  double t0=now();
  for(uint64_t r=0;r<n;r++){uint64_t id=splitmix(r);uint64_t p=(unsigned __int128)mix(id)*cap>>64;
    while(idx[p].slot1){p++; if(p==cap)p=0;} idx[p].id=id; idx[p].slot1=++next; idx[p].touch=1;
    float*row=rows+(uint64_t)(next-1)*2*D; memset(row,0,2*D*4);}
  double t1=now();
  uint64_t B=4096; uint64_t*ids=malloc(B*8); float*g=malloc(B*D*4); for(uint64_t i=0;i<B*D;i++)g[i]=0.01f;
  uint64_t seed=7, done=0; uint64_t hs[32]; int64_t found[32];
  double t2=now();
  while(done<ops){
    for(uint64_t i=0;i<B;i++){seed=splitmix(seed);ids[i]=splitmix(seed%n);}
    for(uint64_t t=0;t<B+2*AHEAD;t++){
      if(t<B){uint64_t h=mix(ids[t]);hs[t%32]=h;uint64_t p=(unsigned __int128)h*cap>>64;__builtin_prefetch(&idx[p]);__builtin_prefetch(&idx[p+2<cap?p+2:0]);}
      if(t>=AHEAD&&t-AHEAD<B){uint64_t j=t-AHEAD;uint64_t p=(unsigned __int128)hs[j%32]*cap>>64;
        while(idx[p].slot1&&idx[p].id!=ids[j]){p++;if(p==cap)p=0;} found[j%32]=p;
        if(idx[p].slot1){float*row=rows+(uint64_t)(idx[p].slot1-1)*2*D;__builtin_prefetch(row);__builtin_prefetch(row+16);}}
      if(t>=2*AHEAD&&t-2*AHEAD<B){uint64_t k=t-2*AHEAD;uint64_t p=found[k%32];
        float*row=rows+(uint64_t)(idx[p].slot1-1)*2*D; idx[p].touch=2; float*w=row,*a=row+D; const float*gg=g+k*D;
        for(int e=0;e<D;e++){a[e]+=gg[e]*gg[e]; w[e]-=0.01f*gg[e]/(sqrtf(a[e])+1e-8f);}}
    }
    done+=B;
  }
  double t3=now();
  printf("model: %llu rows, preload %.2f M/s, updates %.2f M/s\n",(unsigned long long)n,n/(t1-t0)/1e6,done/(t3-t2)/1e6);
  return 0;
}
