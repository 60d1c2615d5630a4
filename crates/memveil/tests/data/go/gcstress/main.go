// GC stress for the Go tests (run with GOGC=25): goroutines that build and
// drop maps of slices, grow and shrink slices, and hand results back over
// channels; prints a checksum of everything computed, so a page that came
// back wrong (or as stale ciphertext after MADV_DONTNEED) changes it or
// crashes the runtime.
// usage: gcstress ROUNDS
package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
)

type rng uint64

func (r *rng) next() uint64 {
	*r ^= *r << 13
	*r ^= *r >> 7
	*r ^= *r << 17
	return uint64(*r)
}

func work(seed uint64, rounds int) uint64 {
	r := rng(seed*0x9E3779B97F4A7C15 + 1)
	var h uint64 = 1469598103934665603
	for k := 0; k < rounds; k++ {
		m := make(map[uint64][]uint64)
		for i := 0; i < 2000; i++ {
			key := r.next() % 1500
			s := m[key]
			s = append(s, r.next())
			m[key] = s
		}
		for key, s := range m {
			for _, v := range s {
				h ^= (key*31 + v) * 0x100000001b3
			}
		}
		big := make([]byte, 1<<20+int(r.next()%(1<<20)))
		for i := 0; i < len(big); i += 4096 {
			big[i] = byte(r.next())
			h = h*1099511628211 + uint64(big[i])
		}
		strs := make([]string, 0, 64)
		for i := 0; i < 500; i++ {
			strs = append(strs, strconv.FormatUint(r.next()%100000, 16))
		}
		for _, s := range strs {
			h = h*1099511628211 + uint64(len(s))
		}
	}
	return h
}

func main() {
	rounds := 30
	if len(os.Args) > 1 {
		if n, err := strconv.Atoi(os.Args[1]); err == nil {
			rounds = n
		}
	}
	const workers = 8
	out := make(chan [2]uint64, workers)
	for w := 0; w < workers; w++ {
		go func(w int) { out <- [2]uint64{uint64(w), work(uint64(w), rounds)} }(w)
	}
	res := make([]uint64, workers)
	for w := 0; w < workers; w++ {
		x := <-out
		res[x[0]] = x[1]
	}
	runtime.GC()
	var h uint64
	for _, v := range res {
		h = h*1099511628211 ^ v
	}
	fmt.Printf("gcstress %d %016x\n", rounds, h)
}
