"""CPU check of the arithmetic behind FWD_ROW_DIVIDE (kernels/gluon_flash.py, ``_div_rows``), in exact rational
arithmetic with FP32 rounding to nearest: for random a (|a| in [2^-64, 2^64)) and b (in [2^-16, 2^32), a third of
them near small integers like a softmax row sum), a reciprocal r0 anywhere within 2 ulp of 1/b (the hardware's
approximation is within 1), r = fma(r0, fma(-b, r0, 1), r0), q0 = RN(a r), e = fma(b, q0, -a), q = fma(-r, e, q0)
equals RN(a / b) (the kernel forms the residual with its sign flipped, so that a signed zero divides to itself; for
a nonzero a that is the same arithmetic as CUDA's e = fma(-b, q0, a), q = fma(r, e, q0)). It also checks the bit
patterns of the kernel's range test against the bounds 2^64 and 2^-64. The GPU test (tests/gpu/test_attention_gluon_gpu.py) compares the kernel's bits themselves.

    python docs/device-runs/2026-12-07-boundary/division_check.py 150000    # prints how many cases differ
"""
import random
import struct
import sys
from fractions import Fraction as F

def rn32(x: F) -> F:
    if x == 0:
        return F(0)
    s = -1 if x < 0 else 1
    m = abs(x)
    e = m.numerator.bit_length() - m.denominator.bit_length()
    while F(2) ** e > m: e -= 1
    while F(2) ** (e + 1) <= m: e += 1
    assert -126 <= e <= 127, e
    n = m * F(2) ** (23 - e)
    i = n.numerator // n.denominator
    rem = n - i
    if rem > F(1, 2) or (rem == F(1, 2) and i % 2 == 1):
        i += 1
    return s * F(i) * F(2) ** (e - 23)

def ulp(x: F) -> F:
    m = abs(x); e = 0
    while F(2) ** e > m: e -= 1
    while F(2) ** (e + 1) <= m: e += 1
    return F(2) ** (e - 23)

def rand32(lo_exp, hi_exp):
    mant = random.getrandbits(23)
    e = random.randint(lo_exp, hi_exp)
    return (F(1) + F(mant, 2 ** 23)) * F(2) ** e * random.choice((1, -1))

def bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


assert bits32(2.0**64) == 0x5F800000 and bits32(2.0**-64) - 1 == 0x1F7FFFFF  # the kernel's range test
random.seed(1)
bad = 0
N = int(sys.argv[1])
for i in range(N):
    b = abs(rand32(-16, 31))
    if i % 3 == 0:  # l near small integers, the common case
        b = F(random.randint(1, 4096)) + F(random.getrandbits(10), 2 ** 10)
        b = rn32(b)
    a = rand32(-64, 63)
    exact_r = 1 / b
    r0 = rn32(exact_r) + random.randint(-2, 2) * ulp(exact_r)
    r = rn32(r0 * rn32(1 - b * r0) + r0)
    q0 = rn32(a * r)
    e = rn32(b * q0 - a)
    q = rn32(q0 - r * e)
    want = rn32(a / b)
    if q != want:
        bad += 1
        if bad < 5: print("BAD", float(a), float(b), float(q), float(want))
print(f"{N} cases, {bad} differ")
