// The shield's Go suite: encoding/json of 150,000 records and back (a Go
// service's request and response bodies). Prints the encoding's length and
// SHA-256, and a checksum of the decoded records.
package main

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
)

type Record struct {
	ID     int               `json:"id"`
	Name   string            `json:"name"`
	Tags   []string          `json:"tags"`
	Score  float64           `json:"score"`
	Labels map[string]string `json:"labels"`
}

func main() {
	n := 150000
	if len(os.Args) > 1 {
		if v, err := strconv.Atoi(os.Args[1]); err == nil {
			n = v
		}
	}
	x := uint64(0x9e3779b97f4a7c15)
	next := func() uint64 { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x }
	recs := make([]Record, n)
	for i := range recs {
		r := next()
		recs[i] = Record{
			ID:     i,
			Name:   fmt.Sprintf("tenant-%08x", r),
			Tags:   []string{strconv.FormatUint(r%977, 10), strconv.FormatUint(r%31, 36)},
			Score:  float64(r%100000) / 7.0,
			Labels: map[string]string{"zone": strconv.FormatUint(r%5, 10), "tier": strconv.FormatUint(r%3, 10)},
		}
	}
	enc, err := json.Marshal(recs)
	if err != nil {
		fmt.Fprintln(os.Stderr, "marshal:", err)
		os.Exit(1)
	}
	var back []Record
	if err := json.Unmarshal(enc, &back); err != nil {
		fmt.Fprintln(os.Stderr, "unmarshal:", err)
		os.Exit(1)
	}
	sum := 0
	for _, r := range back {
		sum += r.ID + len(r.Name) + len(r.Tags[0]) + len(r.Labels["zone"])
	}
	fmt.Printf("%d %x %d\n", len(enc), sha256.Sum256(enc), sum)
}
