// The shield's Go suite: compress/flate at level 6 of 16 MiB of generated
// text and back, checked. Prints the sizes and the compressed SHA-256.
package main

import (
	"bytes"
	"compress/flate"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"strconv"
)

func main() {
	mib := 16
	if len(os.Args) > 1 {
		if v, err := strconv.Atoi(os.Args[1]); err == nil {
			mib = v
		}
	}
	x := uint64(0x5eed0f5eed0f5eed)
	next := func() uint64 { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x }
	words := []string{"lorem", "ipsum", "dolor", "sit", "amet", "memveil", "shield", "tenant", "key", "cipher"}
	var text bytes.Buffer
	for text.Len() < mib<<20 {
		r := next()
		fmt.Fprintf(&text, "%016x %s %s %06d\n", r, words[r%10], words[(r>>8)%10], r%999983)
	}
	var packed bytes.Buffer
	w, err := flate.NewWriter(&packed, 6)
	if err != nil {
		fmt.Fprintln(os.Stderr, "flate:", err)
		os.Exit(1)
	}
	w.Write(text.Bytes())
	w.Close()
	out, err := io.ReadAll(flate.NewReader(bytes.NewReader(packed.Bytes())))
	if err != nil || !bytes.Equal(out, text.Bytes()) {
		fmt.Fprintln(os.Stderr, "round trip failed:", err)
		os.Exit(1)
	}
	fmt.Printf("%d %d %x\n", text.Len(), packed.Len(), sha256.Sum256(packed.Bytes()))
}
