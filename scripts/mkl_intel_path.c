/* Preloaded into a process, MKL takes the code paths it takes on an Intel CPU on any x86 CPU.
 *
 * MKL picks its kernels by CPU vendor as well as by ISA: on an AMD CPU it runs its generic kernels whatever
 * the CPU supports, on an Intel one its AVX-512 (or AVX2, with MKL_ENABLE_INSTRUCTIONS=AVX2) kernels. Its
 * vendor check is one exported function, which this library answers first. scripts/numerics_under_isas.py
 * uses it so that an AMD machine runs the kernels an Intel machine of the project runs, and a numerical
 * claim true on one vendor and false on the other fails on both.
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
