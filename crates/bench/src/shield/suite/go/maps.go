// The shield's Go suite: map-heavy work on four goroutines (a cache with
// inserts, lookups and deletes of string keys and slice values), the
// garbage collector running throughout. Prints a checksum.
package main

import (
	"fmt"
	"os"
	"strconv"
	"sync"
)

func worker(seed uint64, ops int) uint64 {
	x := seed
	next := func() uint64 { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x }
	m := make(map[string][]uint64)
	var sum uint64
	for i := 0; i < ops; i++ {
		r := next()
		k := "k" + strconv.FormatUint((r>>2)%200000, 36)
		switch r % 4 {
		case 0, 1:
			v := make([]uint64, 4+r%12)
			for j := range v {
				v[j] = r + uint64(j)
			}
			m[k] = v
		case 2:
			if v, ok := m[k]; ok {
				sum += v[0] + uint64(len(v))
			}
		default:
			delete(m, k)
		}
	}
	return sum + uint64(len(m))
}

func main() {
	ops := 600000
	if len(os.Args) > 1 {
		if v, err := strconv.Atoi(os.Args[1]); err == nil {
			ops = v
		}
	}
	var wg sync.WaitGroup
	sums := make([]uint64, 4)
	for g := range sums {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			sums[g] = worker(uint64(g+1)*0x9e3779b97f4a7c15, ops)
		}(g)
	}
	wg.Wait()
	fmt.Println(sums[0], sums[1], sums[2], sums[3])
}
