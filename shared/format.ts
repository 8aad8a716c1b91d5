/** Formatting shared by the vmspace command (cli/) and the demo (demo/), which import nothing from each other. */

/** `n` bytes in binary units: `512 B`, `1.5 KiB`, `70 MiB`, `2.25 GiB` (two decimals below 10, one above). */
export function humanBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB']
  let i = 0
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024
    i++
  }
  return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : 1).replace(/\.?0+$/, '')} ${units[i]}`
}
