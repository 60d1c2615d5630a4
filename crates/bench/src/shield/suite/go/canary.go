// The Go canary of memveil's exposure figures (shield.go_canary_*): the C
// canary's protocol (canary.c) in Go. A heap of HEAP_MIB MiB, all of it
// written, a quarter touched continuously; a 64-byte secret in the middle of
// a 1 MiB arena, written after WARM_MS and read every PERIOD_MS (0:
// continuously, -1: never again) until RUN_MS have passed.
//
// Usage: canary HEAP_MIB PERIOD_MS WARM_MS RUN_MS
// Prints "canary SECRET_ADDR SECRET_HEX HEAP_ADDR HEAP_BYTES", "ready",
// "done PASSES SECRET_READS" (stdout).
package main

import (
	"crypto/rand"
	"fmt"
	"os"
	"strconv"
	"time"
	"unsafe"
)

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: canary HEAP_MIB PERIOD_MS WARM_MS RUN_MS")
		os.Exit(2)
	}
	arg := func(i int) int64 {
		v, err := strconv.ParseInt(os.Args[i], 10, 64)
		if err != nil {
			fmt.Fprintln(os.Stderr, "canary: bad number", os.Args[i])
			os.Exit(2)
		}
		return v
	}
	heapBytes := int(arg(1)) << 20
	period, warm, run := arg(2), time.Duration(arg(3))*time.Millisecond, time.Duration(arg(4))*time.Millisecond
	arena := make([]byte, 1<<20)
	for i := range arena {
		arena[i] = 0
	}
	secret := arena[512<<10 : 512<<10+64]
	heap := make([]byte, heapBytes)
	for i := range heap {
		heap[i] = 0x5a
	}
	key := make([]byte, 64)
	if _, err := rand.Read(key); err != nil {
		fmt.Fprintln(os.Stderr, "canary: random:", err)
		os.Exit(1)
	}
	fmt.Printf("canary %p %x %p %d\n", unsafe.Pointer(&secret[0]), key, unsafe.Pointer(&heap[0]), heapBytes)
	pages := heapBytes / 4096
	hot := pages / 4
	order := make([]uint32, hot)
	for i := range order {
		order[i] = uint32(i)
	}
	x := uint64(0x9e3779b97f4a7c15) ^ uint64(key[0])<<8 ^ uint64(key[1])
	next := func() uint64 { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x }
	start := time.Now()
	var written, lastRead time.Time
	var sink uint64
	var passes, reads uint64
	for {
		for i := hot - 1; i > 0; i-- {
			j := int(next() % uint64(i+1))
			order[i], order[j] = order[j], order[i]
		}
		for i := 0; i < hot; i++ {
			off := int(order[i])*4096 + int(passes%512)*8
			heap[off]++
			if !written.IsZero() && period == 0 {
				sink += uint64(secret[i%64])
				reads++
			}
			if i&255 != 0 {
				continue
			}
			t := time.Now()
			if written.IsZero() && t.Sub(start) >= warm {
				copy(secret, key)
				written, lastRead = t, t
				fmt.Println("ready")
			} else if !written.IsZero() && period > 0 && t.Sub(lastRead) >= time.Duration(period)*time.Millisecond {
				for _, b := range secret {
					sink += uint64(b)
				}
				lastRead = t
				reads++
			}
			if !written.IsZero() && t.Sub(written) >= run {
				fmt.Printf("done %d %d\n", passes, reads)
				os.Exit(int(sink & 0))
			}
		}
		passes++
	}
}
