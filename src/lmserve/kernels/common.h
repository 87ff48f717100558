/* Shared by every source of the cpu_kernels.c unity build: includes and the constants several families read. */
#ifndef LMSERVE_KERNELS_COMMON_H
#define LMSERVE_KERNELS_COMMON_H
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__AVXVNNI__)
#include <immintrin.h>
#endif

#define MAX_GROUP_HEADS 256 /* query heads one attention work item may hold (caller asserts H <= this) */

#define F32_MAX_ROWS 8 /* rows of x one pass over the weights serves in registers (longer x: in runs of 8) */
#endif
