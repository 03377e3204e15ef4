/* Which instruction-set level this library was built for (kernels/cpu_isa.py names them), so
 * the Python side can check that what it loaded is what it asked for. */
int pdserve_isa_level(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
    return 5;
#elif defined(__AVX512BF16__)
    return 4;
#elif defined(__AVX512VNNI__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
