// The CPU's float32 FMA peak: 12 independent AVX2 FMA chains per thread, nothing from memory.
// Build and run:  gcc -O2 -mavx2 -mfma -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
// (OMP_NUM_THREADS=1 for one core). docs/results.md#against-the-fma-peak quotes what it printed.
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#define F(x) x=_mm256_fmadd_ps(x,b,c)
int main(){
  long iters=200000000L; double t0=omp_get_wtime(); float out=0;
  #pragma omp parallel reduction(+:out)
  { __m256 b=_mm256_set1_ps(1.0000001f), c=_mm256_set1_ps(1e-7f);
    __m256 a0=_mm256_set1_ps(0),a1=_mm256_set1_ps(1),a2=_mm256_set1_ps(2),a3=_mm256_set1_ps(3),a4=_mm256_set1_ps(4),a5=_mm256_set1_ps(5),a6=_mm256_set1_ps(6),a7=_mm256_set1_ps(7),a8=_mm256_set1_ps(8),a9=_mm256_set1_ps(9),a10=_mm256_set1_ps(10),a11=_mm256_set1_ps(11);
    for(long it=0;it<iters;it++){F(a0);F(a1);F(a2);F(a3);F(a4);F(a5);F(a6);F(a7);F(a8);F(a9);F(a10);F(a11);}
    __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7)));
    s=_mm256_add_ps(s,_mm256_add_ps(_mm256_add_ps(a8,a9),_mm256_add_ps(a10,a11))); out+=s[0]; }
  double t=omp_get_wtime()-t0; int n=omp_get_max_threads();
  printf("threads %d  %.1f GFLOP/s (%.1f per core) %f\n", n, n*iters*12*8*2/t/1e9, iters*12*8*2/t/1e9, out);
}
